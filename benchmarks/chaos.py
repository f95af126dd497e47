"""A run that cannot be killed: one training job killed many times at random moments, requeued each time, and its
end state bit-equal to the same job run without interruption.

Usage::

    python benchmarks/chaos.py --kills 100 --steps 360 --seed 49 --out /tmp/chaos   # RESULTS.md's run

The job is ``benchmarks/chaos_run.py`` (the classification example under ``VitScaleStrategy(async_save=True,
auto_resume=True)`` with ``ShardedEMA``, streamed tar shards with loader workers, a ``ModelCheckpoint`` every 3
steps), started as a user starts it (``python benchmarks/chaos_run.py ...``: Lightning's launcher starts rank 1).
Before each attempt the driver draws, from ``--seed``, a rank, a signal (SIGKILL, or SIGTERM one time in four) and
a moment: a random time after both ranks started (sent by the driver), or the ``at``-th occurrence in the attempt
of a step, a validation batch, a background checkpoint write, a commit (between its two steps), a removal or a
restore (sent by the rank to itself, ``chaos_run.py``); the first ``len(KINDS)`` kills cover every kind. Whatever
the attempt's end, the same command runs again, as a cluster's requeue would, until ``--kills`` kills happened
and an attempt finished. Each kill must end the whole job (every rank gone) within ``ENDED_WITHIN_S``; an attempt
that fails without a kill, or outlives ``--attempt-timeout``, fails the run.

Then the reference (the same command, never killed) and the two final checkpoints (``last.ckpt``, read through
``load_consolidated``, CRC-checked) are compared: weights, optimizer states, the learning-rate schedule, the EMA
and its update count, the data stream's position, the loops' progress and the global step, bit for bit; and every
loss any attempt logged equals the reference's at that step and rank. ``report.json`` holds the seed, every kill's
moment, each job's end after it, and the differences (none: the run passed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.chaos_run import KINDS  # noqa: E402
from tests.helpers.launch import Identity, alive, free_port, python_command, read_identity  # noqa: E402

JOB = "benchmarks/chaos_run.py"
ENDED_WITHIN_S = 45.0  # the strategy's notice grace (30 s) is the longest wait a dead peer can cause
SIGTERM_SHARE = 0.25
TIMED_MAX_S = 8.0  # a timed kill lands this long at most after both ranks started
Launch = Callable[[list[str]], tuple[list[str], dict[str, str]]]


def launch(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """``python JOB *args`` as a user types it (forked from the tests' zygote when it is on: no re-import per rank)."""
    return python_command(JOB, *args, MASTER_PORT=str(free_port()))


@dataclass
class Attempt:
    number: int
    plan: dict[str, Any] | None
    returncode: int | None = None
    seconds: float = 0.0
    killed: dict[str, Any] | None = None  # the kill's moment, as the rank or the driver recorded it
    ended_s: float | None = None  # from the kill to the last rank's exit
    finished: bool = False


@dataclass
class Report:
    seed: int
    steps: int
    attempts: list[Attempt] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def kills(self) -> list[dict[str, Any]]:
        return [a.killed for a in self.attempts if a.killed is not None]

    def summary(self) -> str:
        kinds = sorted({k["kind"] for k in self.kills})
        ended = max((a.ended_s for a in self.attempts if a.ended_s is not None), default=0.0)
        verdict = "bit-equal to the uninterrupted run" if not self.differences else f"{len(self.differences)} diffs"
        return (f"seed {self.seed}: {len(self.kills)} kills ({', '.join(kinds)}) over {len(self.attempts)} attempts,"
                f" {self.steps} steps, {self.seconds:.0f} s; every job ended <= {ended:.1f} s after its kill;"
                f" end state {verdict}")  # fmt: skip


def draw_plan(rng: random.Random, number: int, done: list[str], has_checkpoint: bool) -> dict[str, Any]:
    """Where attempt ``number`` dies: the kinds not yet covered first (in a random order), then any."""
    kinds = [k for k in KINDS if k != "restore" or has_checkpoint]
    fresh = [k for k in kinds if k not in done]
    kind = rng.choice(fresh or kinds)
    rank = 0 if kind in ("commit", "remove") else rng.randrange(2)  # rank 0 commits and removes
    at = {"step": rng.randint(1, 6), "validation": rng.randint(1, 4), "save": rng.randint(1, 2),
          "commit": rng.randint(1, 2), "remove": 1, "restore": 1, "timed": 0}[kind]  # fmt: skip
    plan = {"attempt": number, "kind": kind, "rank": rank, "at": at,
            "signal": "SIGTERM" if rng.random() < SIGTERM_SHARE else "SIGKILL"}  # fmt: skip
    if kind == "timed":
        plan["after_s"] = round(rng.uniform(0.0, TIMED_MAX_S), 2)
    if kind == "commit":
        plan["variant"] = rng.choice(["unmarked", "retired"])
    return plan


def rank_pids(run: Path) -> dict[int, Identity]:
    """Each rank's pid and start time (``/proc`` clock ticks), as it wrote them at setup."""
    found = {rank: read_identity(run / "pids" / f"rank{rank}") for rank in (0, 1)}
    return {rank: identity for rank, identity in found.items() if identity is not None}


def run_attempt(run: Path, job_args: list[str], attempt: Attempt, timeout: float, start_job: Launch) -> None:
    """One attempt of the job: start it, deliver a timed kill, wait for every rank to be gone (bounded)."""
    for stale in [*(run / "pids").glob("rank*"), *run.glob("phase-rank*")]:
        stale.unlink()
    (run / "plan.json").write_text(json.dumps(attempt.plan or {}))
    cmd, env = start_job(job_args)
    start, wall = time.monotonic(), time.time()
    with open(run / f"attempt-{attempt.number}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        plan = attempt.plan or {}
        if plan.get("kind") == "timed":
            attempt.killed = timed_kill(run, plan, proc, start, timeout)
        try:
            proc.wait(max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            kill_rest(proc, run)
            raise RuntimeError(f"attempt {attempt.number} outlived {timeout:.0f} s: a hang (log: {log.name})") from None
    attempt.returncode = proc.returncode
    pids = rank_pids(run)
    deadline = time.monotonic() + ENDED_WITHIN_S
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended, ended_wall = time.monotonic(), time.time()
    stragglers = [pid for pid, started in pids.values() if alive((pid, started))]
    if stragglers:
        kill_rest(proc, run)
    attempt.seconds = ended - start
    attempt.finished = proc.returncode == 0 and all((run / f"done-rank{r}").exists() for r in (0, 1))
    if attempt.killed is None:
        attempt.killed = own_kill(run, attempt.number)
    if attempt.killed is not None:  # seconds from the attempt's start to the kill, from the kill to the job's end
        attempt.killed["t"] = round(attempt.killed["wall"] - wall, 2)
        attempt.ended_s = round(ended_wall - attempt.killed["wall"], 2)
    if stragglers:
        raise RuntimeError(f"attempt {attempt.number}: ranks {stragglers} still ran {ENDED_WITHIN_S:.0f} s after the"
                           f" job's process ended ({run / f'attempt-{attempt.number}.log'})")  # fmt: skip


def timed_kill(run: Path, plan: dict[str, Any], proc: subprocess.Popen, start: float, timeout: float) -> dict | None:
    """The driver's own kill: ``after_s`` seconds after both ranks wrote their pids; ``None`` if the job ended first."""
    while len(rank_pids(run)) < 2:
        if proc.poll() is not None or time.monotonic() - start > timeout:
            return None
        time.sleep(0.02)
    deadline = time.monotonic() + plan["after_s"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        time.sleep(0.01)
    victim, _ = rank_pids(run)[plan["rank"]]
    phase_file = run / f"phase-rank{plan['rank']}"
    try:
        phase = json.loads(phase_file.read_text())["phase"] if phase_file.exists() else "starting"
    except ValueError:
        phase = "(phase being written)"
    moment = {**plan, "phase": phase, "wall": time.time(), "step": _step_of(phase)}
    try:
        os.kill(victim, getattr(signal, plan["signal"]))
    except ProcessLookupError:
        return None
    return moment


def _step_of(phase: str) -> int | None:
    words = [w for w in phase.split() if w.isdigit()]
    return int(words[-1]) if words else None


def own_kill(run: Path, number: int) -> dict[str, Any] | None:
    """The kill a rank sent itself in attempt ``number`` (``kills.jsonl``)."""
    path = run / "kills.jsonl"
    moments = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((m for m in moments if m.get("attempt") == number), None)


def kill_rest(proc: subprocess.Popen, run: Path) -> None:
    """Whatever of a hung attempt still runs: the command's process tree, the ranks (forked elsewhere under the
    zygote) and their loader workers; only processes still alive as themselves, never a pid reused since."""
    from tests.helpers.launch import descendants

    ranks = [pid for pid, started in rank_pids(run).values() if alive((pid, started))]
    job = [proc.pid, *descendants(proc.pid)] if proc.poll() is None else []
    for pid in job + ranks + [d for p in ranks for d in descendants(p)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def job(out: Path, steps: int, cache: Path) -> tuple[Path, list[str]]:
    run = out
    run.mkdir(parents=True, exist_ok=True)
    (run / "pids").mkdir(exist_ok=True)
    return run, [str(run), "--steps", str(steps), "--cache", str(cache)]


def chaos(out: Path, kills: int, steps: int, seed: int, attempt_timeout: float = 300.0,
          start_job: Launch = launch) -> Report:  # fmt: skip
    """The killed run in ``out/chaos`` and the reference in ``out/reference``; the report (also ``report.json``)."""
    started = time.monotonic()
    report, rng = Report(seed, steps), random.Random(seed)
    cache = out / "cache"
    reference, ref_args = job(out / "reference", steps, cache)
    run, run_args = job(out / "chaos", steps, cache)
    ref = Attempt(0, None)
    run_attempt(reference, ref_args, ref, attempt_timeout, start_job)  # also writes the digits' shards, once
    if not ref.finished:
        raise RuntimeError(f"the reference run failed: {reference / 'attempt-0.log'}")
    done: list[str] = []
    number = 0
    while True:
        number += 1
        plan = None
        if len(report.kills) < kills:
            plan = draw_plan(rng, number, done, has_checkpoint=(run / "ckpts").exists())
        attempt = Attempt(number, plan)
        report.attempts.append(attempt)
        run_attempt(run, run_args, attempt, attempt_timeout, start_job)
        if attempt.killed is not None:
            done.append(attempt.killed["kind"])
        elif not attempt.finished:
            raise RuntimeError(f"attempt {number} failed without a kill: {run / f'attempt-{number}.log'}")
        if attempt.finished:  # the run is over (with fewer kills than asked if its steps ran out first)
            break
    report.differences = compare(reference, run)
    report.seconds = time.monotonic() - started
    (out / "report.json").write_text(json.dumps({**asdict(report), "kills": report.kills}, indent=1))
    return report


def compare(reference: Path, run: Path) -> list[str]:
    """Every difference between the two runs' end states and logged losses (empty: bit-equal)."""
    from lightning_vitscale.checkpoint import load_consolidated

    a, b = (load_consolidated(p / "ckpts" / "last.ckpt") for p in (reference, run))
    for checkpoint, folder in ((a, reference), (b, run)):
        # ModelCheckpoint's state names its own folder: compared without it. Lightning does not run again a
        # validation due right after the save it resumes from (it moves its counters past one pass, the same
        # under DDP): the validation loop's counters are left out.
        checkpoint["callbacks"] = _without_paths(checkpoint["callbacks"], str(folder))
        fit_loop = checkpoint["loops"]["fit_loop"]
        checkpoint["loops"]["fit_loop"] = {k: v for k, v in fit_loop.items() if "val_loop" not in k}
    found = [d for key in sorted(a.keys() | b.keys()) for d in differences(a.get(key), b.get(key), key)]
    return found + loss_differences(reference, run)


def _without_paths(value: Any, folder: str) -> Any:
    if isinstance(value, str):
        return value.replace(folder, "RUN")
    if isinstance(value, dict):
        return {_without_paths(k, folder): _without_paths(v, folder) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_paths(v, folder) for v in value)
    return value


def differences(a: Any, b: Any, where: str) -> list[str]:
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))[:5]} in one only"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def losses(run: Path) -> list[tuple[int, int, float, Any]]:
    """Every (rank, step, loss, attempt) the run logged, in order."""
    out = []
    for rank in (0, 1):
        for line in (run / f"losses-rank{rank}.jsonl").read_text().splitlines():
            r = json.loads(line)
            out.append((rank, r["step"], r["loss"], r.get("attempt")))
    return out


def loss_differences(reference: Path, run: Path) -> list[str]:
    want = {(rank, step): loss for rank, step, loss, _ in losses(reference)}
    got = losses(run)
    found = [f"loss at step {step}, rank {rank}, attempt {attempt}: {loss!r} vs {want.get((rank, step))!r}"
             for rank, step, loss, attempt in got if want.get((rank, step)) != loss]  # fmt: skip
    missing = sorted(want.keys() - {(rank, step) for rank, step, _, _ in got})
    return found + ([f"steps never logged: {missing[:10]}"] if missing else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--steps", type=int, default=360)
    parser.add_argument("--seed", type=int, default=49)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--attempt-timeout", type=float, default=600.0)
    args = parser.parse_args()
    report = chaos(args.out, args.kills, args.steps, args.seed, args.attempt_timeout)
    print(report.summary())
    for attempt in report.attempts:
        k = attempt.killed
        if k is not None:
            print(f"  attempt {attempt.number}: {k['signal']} rank {k['rank']} {k['kind']}: {k['phase']}"
                  f" (step {k.get('step')}), job ended {attempt.ended_s} s later")  # fmt: skip
    for line in report.differences[:20]:
        print("  DIFF", line)
    sys.exit(1 if report.differences else 0)


if __name__ == "__main__":
    main()
