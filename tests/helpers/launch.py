"""The one helper that spawns ranks: torch's elastic launcher (or Lightning's own), always bounded in time."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.helpers.ports import free_port

if TYPE_CHECKING:
    import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


# What Lightning writes into os.environ during an in-process fit (devices=1 sets LOCAL_RANK=0, NODE_RANK=0 and a
# MASTER_PORT): inherited by a launch, LOCAL_RANK makes Lightning's launcher think the ranks were started
# externally, so rank 0 waits for a rank 1 that never starts. Each launch sets what it needs itself.
_LIGHTNING_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def rank_env(**extra: str) -> dict[str, str]:
    """Environment for child ranks: one thread each on the 2-core CI machine, loopback gloo."""
    env = dict(os.environ)
    for leaked in _LIGHTNING_RANK_VARIABLES:  # set by an in-process fit earlier in this pytest process
        env.pop(leaked, None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",  # a rank that crashes (SIGABRT, SIGSEGV) prints each thread's Python stack
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


@dataclass
class Finished:
    returncode: int
    output: str
    seconds: float
    timed_out: bool


def run_bounded(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Finished:
    """Run ``cmd`` in its own process group; on timeout kill the whole group so no rank outlives the test."""
    import time

    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env or rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        below = descendants(proc.pid)  # before the kill: orphans are re-parented and could no longer be found
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    finished = Finished(proc.returncode, out, time.monotonic() - start, timed_out)
    _log_launch(cmd, finished)
    return finished


def _log_launch(cmd: list[str], finished: Finished) -> None:
    """With ``VITSCALE_TEST_LAUNCH_LOG=FILE``, one JSON line per launch (test, command, seconds, exit code): where a
    test run's time goes in launches, which ``--durations`` cannot tell apart from a test's own work."""
    log = os.environ.get("VITSCALE_TEST_LAUNCH_LOG")
    if not log:
        return
    import json

    entry = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "cmd": [Path(c).name if os.sep in c else c for c in cmd],
        "seconds": round(finished.seconds, 1),
        "returncode": finished.returncode,
    }
    with open(log, "a") as file:
        file.write(json.dumps(entry) + "\n")


Identity = tuple[int, str]  # a process's pid and start time (``/proc`` clock ticks): a later one with its pid differs


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (the state first), or ``None`` where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def record_identity(path: Path) -> None:
    """Write this process's :data:`Identity` to ``path`` (a rank script's, a loader worker's), for
    :func:`read_identity` and :func:`alive` in the process watching it."""
    fields = _stat_fields("self")
    assert fields is not None
    path.write_text(f"{os.getpid()} {fields[19]}")


def read_identity(path: Path) -> Identity | None:
    """What :func:`record_identity` wrote, or ``None`` where nothing (whole) is there yet."""
    words = path.read_text().split() if path.exists() else []
    return (int(words[0]), words[1]) if len(words) == 2 else None


def alive(process: Identity) -> bool:
    """Whether a process still runs: not a zombie, not another process that got its pid since."""
    pid, started = process
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z" and fields[19] == started


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: torchrun starts each rank in a session of its own, which ``killpg`` misses
    (a rank blocked in a collective, with Lightning's SIGTERM handler, then outlives the test holding its pipe)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not Linux's layout
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        below = children.get(stack.pop(), [])
        found.extend(below)
        stack.extend(below)
    return found


def torchrun(script: str | Path, *args: str, nprocs: int = 2, timeout: float = 240, **env: str) -> Finished:
    """Launch ``script`` on ``nprocs`` CPU ranks with torch's public elastic launcher.

    Without extra ``env`` (which a fork could not honour), the launcher and each rank are forked from a process
    that imported torch and Lightning once (``python_command``): the same launcher, ranks, environment and exit
    codes, without ~10 s of imports per rank and ~3 s per launcher."""
    cmd, full_env = python_command(
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nprocs}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        str(script),
        *args,
        **env,
    )
    return run_bounded(cmd, timeout, full_env)


# Read by Lightning or torch.distributed when a job starts, not by Python or a library at import: a rank forked
# from the zygote honours them as a fresh process would.
_READ_AT_RUN_TIME = frozenset({"MASTER_PORT", "NODE_RANK"})


def _zygote_socket() -> str | None:
    from tests.helpers import zygote

    return zygote.server_socket(rank_env(), REPO_ROOT) if zygote.enabled() else None


def python_command(*args: str, **env: str) -> tuple[list[str], dict[str, str]]:
    """``python *args`` as a user types it, with ``env`` over the ranks' base environment. Forked from the zygote
    (tests/helpers/zygote.py), the ranks Lightning's launcher starts included, unless ``env`` holds something only
    a fresh process reads: the same script, launcher and exit codes without ~10 s of imports per process."""
    from tests.helpers import zygote

    socket_path = _zygote_socket() if set(env) <= _READ_AT_RUN_TIME else None
    if socket_path is None:
        return [sys.executable, *args], rank_env(**env)
    client = str(Path(zygote.__file__).with_name("zygote_client.py"))
    return [sys.executable, client, *args], rank_env(**env, **{zygote.SOCKET_VARIABLE: socket_path})


def lightning_launch(script: str | Path, *args: str, timeout: float = 240, **env: str) -> Finished:
    """Run ``script`` as a user would: Lightning's own launcher starts the other ranks."""
    cmd, full_env = python_command(str(script), *args, MASTER_PORT=str(free_port()), **env)
    return run_bounded(cmd, timeout, full_env)


def crash_reports(output: str) -> str:
    """Each crashed rank's stacks (faulthandler's "Fatal Python error" report, without its list of extension
    modules): a tail of the output shows the peers' errors and the launcher's summary, not what crashed first."""
    reports = re.findall(r"Fatal Python error.*?(?=\n\s*Extension modules|\Z)", output, flags=re.DOTALL)
    return "".join(f"{report[:4000]}\n...\n" for report in reports)


def assert_ok(result: Finished) -> None:
    tail = crash_reports(result.output) + result.output[-6000:]
    assert not result.timed_out, f"timed out after {result.seconds:.0f}s:\n{tail}"
    assert result.returncode == 0, f"exit code {result.returncode}:\n{tail}"


def launch_ranks(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    script: str | Path,
    *args: str,
    pattern: str | None = "rank*.json",
    nprocs: int = 2,
    timeout: float = 240,
    **env: str,
) -> tuple[Path, list[dict]]:
    """The body of every module-scoped launch fixture: ``script OUT *args`` on ``nprocs`` ranks through torch's
    elastic launcher (one launch running all of a module's scenarios), failing with the output's tail unless every
    rank exits 0 in time; returns OUT and the per-rank results matching ``pattern`` (``None``: read none)."""
    from tests.helpers.results import load_ranks

    out = tmp_path_factory.mktemp(name)
    result = torchrun(script, str(out), *args, nprocs=nprocs, timeout=timeout, **env)
    crashed = crash_reports(result.output) if result.returncode != 0 and not result.timed_out else ""
    if crashed:  # a native crash (once in CI: SIGABRT in gloo, never reproduced): said, then run once more
        import warnings

        warnings.warn(f"{script}: a rank crashed; launched again. Its report:\n{crashed[:3000]}", stacklevel=2)
        out = tmp_path_factory.mktemp(name)
        result = torchrun(script, str(out), *args, nprocs=nprocs, timeout=timeout, **env)
    assert_ok(result)
    # where the launch's time went (run_scenarios prints each scenario's seconds): `pytest -rP` shows it
    print("\n".join(line for line in result.output.splitlines() if "scenario " in line and line.endswith(" s")))
    return out, (load_ranks(out, pattern) if pattern else [])


def slurm_launch(script: str | Path, *args: str, ntasks: int = 2, timeout: float = 240) -> list[Finished]:
    """Start ``ntasks`` processes the way ``srun --ntasks-per-node`` does (SLURM_* variables, no launcher).

    Each is ``python script`` forked from the zygote like the ranks of the other launches (``python_command``): the
    SLURM_* variables are read when the Trainer starts (Lightning's SLURMEnvironment; its import-time rank is reset
    in the fork from ``SLURM_PROCID``), and two fresh processes spent ~9 s of the test importing."""
    import time

    port = str(free_port())
    cmd, base = python_command(str(script), *args)
    procs = []
    for rank in range(ntasks):
        env = dict(
            base, SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_NAME="vitscale-test", SLURM_JOB_ID="4242",
            SLURM_NODELIST="127.0.0.1", MASTER_PORT=port,
        )
        procs.append(subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        ))
    start, results = time.monotonic(), []
    for proc in procs:
        remaining = max(1.0, timeout - (time.monotonic() - start))
        try:
            out, _ = proc.communicate(timeout=remaining)
            results.append(Finished(proc.returncode, out, time.monotonic() - start, False))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            results.append(Finished(proc.returncode, out, time.monotonic() - start, True))
    return results


def multinode_launch(
    script: str | Path, *args: str, nodes: int = 2, per_node: int = 2, launcher: str = "torchrun", timeout: float = 240
) -> list[Finished]:
    """Start ``nodes`` "nodes" on this machine, each its own process tree, as a cluster's per-node command would.

    ``launcher="torchrun"``: ``torchrun --nnodes N --node-rank i`` per node (static rendezvous at
    MASTER_ADDR:MASTER_PORT). ``launcher="lightning"``: ``python script.py`` per node with ``NODE_RANK`` /
    ``MASTER_ADDR`` / ``MASTER_PORT`` set, and Lightning's launcher starts the node's other ranks (the script
    passes ``num_nodes=N``). The nodes run concurrently, each bounded by ``timeout`` through ``run_bounded``.
    """
    from concurrent.futures import ThreadPoolExecutor

    port = str(free_port())

    def node_command(node: int) -> tuple[list[str], dict[str, str]]:
        if launcher == "torchrun":
            return python_command(
                "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
                f"--nproc-per-node={per_node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                "--max-restarts=0", str(script), *args,
            )
        if launcher == "lightning":
            return python_command(str(script), *args, NODE_RANK=str(node), MASTER_PORT=port)
        raise ValueError(f"launcher must be 'torchrun' or 'lightning'; got {launcher!r}")

    commands = [node_command(node) for node in range(nodes)]
    with ThreadPoolExecutor(max_workers=nodes) as pool:
        futures = [pool.submit(run_bounded, cmd, timeout, env) for cmd, env in commands]
        return [future.result() for future in futures]
