"""Per-rank memory on CPU ranks: DDP vs VitScaleStrategy (state bytes), and activation checkpointing on vs off.

Usage (each run is launched with torch's elastic launcher and killed after ``--timeout`` seconds)::

    python benchmarks/cpu_scaling.py                 # all runs, prints a Markdown table, writes cpu_scaling.json
    python benchmarks/cpu_scaling.py --ranks 1 2     # fewer rank counts

Two measurements, because they answer different questions:

* ``state``: a ~38M-parameter ViT (TinyViT dim 512, depth 12). ``measure_state_bytes`` counts the parameter,
  gradient and AdamW-state bytes each rank holds after 2 steps: exact, independent of the allocator.
* ``activations``: a ViT whose activations dominate (1024 tokens, width 96, depth 12). Peak process memory
  during ``fit`` (VmHWM, reset when training starts) with activation checkpointing on vs off, and the RSS
  left after ``malloc_trim(0)`` (glibc otherwise keeps freed memory and hides what is really held).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.ports import free_port  # noqa: E402 - after the checkout is importable

MIB = 2**20

MODELS = {  # TinyViT keyword arguments, per-rank batch size
    "state": (dict(image=32, patch=4, dim=512, depth=12), 4),
    "activations": (dict(image=128, patch=4, dim=96, depth=12), 8),
}


# --- worker: one rank -------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _trimmed_rss_mib() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_kib("VmRSS") / 1024


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT))
    from lightning_vitscale import VitScaleStrategy, measure_state_bytes
    from lightning_vitscale.cli.demo import TinyViT, generated_images

    class PeakDuringFit(L.Callback):
        """Reset the kernel's peak-RSS mark when training starts, read it when training ends."""

        def on_train_start(self, trainer, pl_module):
            self.before = _trimmed_rss_mib()
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

        def on_train_end(self, trainer, pl_module):
            self.hwm = _status_kib("VmHWM") / 1024

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    kwargs, batch = MODELS[args.model]
    L.seed_everything(0, verbose=False)
    model = TinyViT(**kwargs)
    strategy = "ddp" if args.strategy == "ddp" else VitScaleStrategy(activation_checkpointing=args.ac == "on")
    peak = PeakDuringFit()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[peak],
    )
    data = generated_images(n=batch * world * args.steps, image=kwargs["image"])
    start = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=batch))
    seconds = time.perf_counter() - start
    state = measure_state_bytes(model, trainer.optimizers)
    row = [
        state.params_local, state.grads_local, state.optimizer_local, state.params_full,
        peak.before, peak.hwm, _trimmed_rss_mib(), seconds,
    ]
    gathered = trainer.strategy.all_gather(torch.tensor(row, dtype=torch.float64)).reshape(world, -1).tolist()
    if trainer.is_global_zero:
        keys = ["params", "grads", "optimizer", "params_full", "rss_before_mib", "hwm_mib", "rss_end_mib", "fit_s"]
        Path(args.out).write_text(json.dumps([dict(zip(keys, r)) for r in gathered]))


# --- driver: launches the ranks -----------------------------------------------------------------------------


def launch(model: str, strategy: str, ac: str, ranks: int, steps: int, timeout: float) -> list[dict] | str:
    out = HERE / f".cpu_scaling_{model}_{strategy}_{ac}_{ranks}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0", str(Path(__file__)),
        "--worker", f"--model={model}", f"--strategy={strategy}", f"--ac={ac}", f"--steps={steps}", f"--out={out}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode or not out.exists():
        return f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}"
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def runs(ranks: list[int]) -> list[tuple[str, str, str, int]]:
    state = [("state", s, "-" if s == "ddp" else "on", n) for n in ranks for s in ("ddp", "vitscale")]
    acts = [("activations", s, ac, n) for n in ranks if n <= 2 for s, ac in (("ddp", "-"), ("vitscale", "off"),
                                                                            ("vitscale", "on"))]
    return state + acts


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | strategy | AC | ranks | params MiB/rank | grads MiB/rank | AdamW state MiB/rank | total MiB/rank"
        " | peak RSS during fit MiB (VmHWM, max rank) | RSS after malloc_trim MiB (max rank) | fit s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows = r["rows"]
        if isinstance(rows, str):
            lines.append(f"| {r['model']} | {r['strategy']} | {r['ac']} | {r['ranks']} | failed: {rows[:80]} |||||||")
            continue
        p, g, o = (max(x[k] for x in rows) / MIB for k in ("params", "grads", "optimizer"))
        hwm, end = max(x["hwm_mib"] for x in rows), max(x["rss_end_mib"] for x in rows)
        fit = max(x["fit_s"] for x in rows)
        ac = "-" if r["strategy"] == "ddp" else r["ac"]
        lines.append(
            f"| {r['model']} | {r['strategy']} | {ac} | {r['ranks']} | {p:.1f} | {g:.1f} | {o:.1f} |"
            f" {p + g + o:.1f} | {hwm:.0f} | {end:.0f} | {fit:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", default=str(HERE / "cpu_scaling.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="state", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=["ddp", "vitscale"], default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--ac", choices=["on", "off", "-"], default="on", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = []
    for model, strategy, ac, n in runs(args.ranks):
        start = time.monotonic()
        rows = launch(model, strategy, ac, n, args.steps, args.timeout)
        print(f"{model:12s} {strategy:9s} ac={ac:3s} ranks={n}: {time.monotonic() - start:5.0f} s", flush=True)
        results.append(dict(model=model, strategy=strategy, ac=ac, ranks=n, rows=rows))
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
