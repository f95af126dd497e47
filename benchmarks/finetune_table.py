"""The fine-tuning table: DINO teacher vs from scratch vs a linear probe, at a fraction of the digits' labels.

Usage::

    python benchmarks/finetune_table.py                    # pretrain once, then 4 starts x 2 strategies x 2 seeds
    python benchmarks/finetune_table.py --seeds 0 --dino runs/dino/last.ckpt   # reuse a pretraining run

Steps, each as a user types it (``python examples/<task>.py fit ...``, the examples' CLIs, CPU):

1. DINO pretraining on the digits' training split, no labels (``examples/pretraining.py``, one process with every
   core, ``--pretrain-epochs``), its last checkpoint kept (a sharded folder).
2. At ``--data.label_fraction`` (10%: a class-stratified subset of the same training split, the same for every
   run; validation is the full 360 images), for the same ``--epochs`` and each seed (``--seed_everything``: head
   and scratch init, shuffling, drop-path): full fine-tuning from the teacher (``--model.layer_decay=0.75
   --model.drop_path=0.1``, examples/README.md's command), a linear probe on the teacher
   (``--model.freeze_backbone=true``), the same probe at 10x the learning rate, and the same ViT from scratch;
   each under ``--trainer.strategy=vitscale`` and ``--trainer.strategy=ddp`` on 2 CPU ranks (``--trainer.devices=2``,
   one thread each).

The final epoch's ``val_acc`` and ``val_loss`` come from each run's CSV logger; the script prints a Markdown table
and the largest vitscale-ddp difference per seed.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers.ports import free_port  # noqa: E402 - after the checkout is importable

STRATEGIES = ("vitscale", "ddp")
TEACHER = ["--model.weights_key=teacher"]
PROBE = [*TEACHER, "--model.freeze_backbone=true"]
STARTS = {  # name: (row, options); the README's fine-tuning commands, the path of the DINO run goes in front
    "finetune": ("DINO teacher, fine-tuned", [*TEACHER, "--model.layer_decay=0.75", "--model.drop_path=0.1"]),
    "probe": ("DINO teacher, linear probe", PROBE),
    # the head alone at the example's lr (3e-3) barely moves in 40 x 3 steps: the same probe at 10x the lr
    "probe-lr": ("DINO teacher, linear probe, lr 0.03", [*PROBE, "--model.lr=0.03"]),
    "scratch": ("from scratch", []),
}


def run(script: str, args: list[str], log_dir: Path, threads: str) -> tuple[Path, float]:
    """``python examples/<script> fit ...`` with its CSV logger in ``log_dir``; returns metrics.csv and seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS=threads, MASTER_PORT=str(free_port()))
    cmd = [sys.executable, f"examples/{script}", "fit", "--trainer.accelerator=cpu",
           "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={log_dir}", *args]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return next(log_dir.glob("*/version_0/metrics.csv")), seconds


def last(metrics: Path, column: str) -> float:
    rows = [r[column] for r in csv.DictReader(metrics.open()) if r.get(column)]
    if not rows:
        sys.exit(f"no {column!r} in {metrics}")
    return float(rows[-1])


def pretrain(out: Path, epochs: int) -> Path:
    metrics, seconds = run(
        "pretraining.py",
        ["--trainer.devices=1", f"--trainer.max_epochs={epochs}", "--trainer.callbacks+=ModelCheckpoint",
         f"--trainer.callbacks.dirpath={out / 'dino'}", "--trainer.callbacks.save_last=true"],
        out / "logs" / "dino", threads=str(os.cpu_count() or 1),
    )  # fmt: skip
    print(f"DINO: {epochs} epochs, 1 process, {seconds:.0f} s, teacher k-NN {last(metrics, 'knn_acc'):.3f}", flush=True)
    return out / "dino" / "last.ckpt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-epochs", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=30, help="fine-tuning epochs, the same for every start")
    parser.add_argument("--label-fraction", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--starts", nargs="+", choices=list(STARTS), default=list(STARTS))
    parser.add_argument("--dino", type=Path, help="a DINO run's checkpoint to start from (skips pretraining)")
    parser.add_argument("--out", type=Path, help="where runs and logs go (default: a temporary folder)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="finetune_table_"))
    dino = args.dino or pretrain(out, args.pretrain_epochs)
    common = ["--trainer.devices=2", f"--trainer.max_epochs={args.epochs}", "--trainer.enable_checkpointing=false",
              f"--data.label_fraction={args.label_fraction}"]  # fmt: skip
    results: dict[tuple[str, int, str], tuple[float, float, float]] = {}
    for seed in args.seeds:
        for start, extra in (STARTS[name] for name in args.starts):
            weights = [f"--model.weights={dino}"] if extra else []
            for strategy in STRATEGIES:
                log_dir = out / "logs" / f"{start.replace(' ', '_').replace(',', '')}-{strategy}-seed{seed}"
                metrics, seconds = run(
                    "classification.py",
                    [*common, f"--trainer.strategy={strategy}", f"--seed_everything={seed}", *weights, *extra],
                    log_dir, threads="1",
                )  # fmt: skip
                results[start, seed, strategy] = (last(metrics, "val_acc"), last(metrics, "val_loss"), seconds)
                print(start, strategy, seed, results[start, seed, strategy], flush=True)
    print(f"\n{args.label_fraction:.0%} of the labels, {args.epochs} epochs, 2 CPU ranks; val_acc (val_loss)\n")
    header = " | ".join(f"seed {s}, {st}" for s in args.seeds for st in STRATEGIES)
    print(f"| start | {header} | seconds per run |\n|---|{'---|' * len(args.seeds) * 2}---|")
    for start in (STARTS[name][0] for name in args.starts):
        cells = [results[start, s, st] for s in args.seeds for st in STRATEGIES]
        row = " | ".join(f"{acc:.4f} ({loss:.4f})" for acc, loss, _ in cells)
        print(f"| {start} | {row} | {min(c[2] for c in cells):.0f}-{max(c[2] for c in cells):.0f} |")
    for seed in args.seeds:
        rows = [STARTS[name][0] for name in args.starts]
        gaps = [abs(results[r, seed, "vitscale"][i] - results[r, seed, "ddp"][i]) for r in rows for i in (0, 1)]
        print(f"seed {seed}: largest |vitscale - ddp| over val_acc and val_loss: {max(gaps):.2e}")
    print(f"\nruns and logs: {out}")


if __name__ == "__main__":
    main()
