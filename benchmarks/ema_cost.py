"""What ShardedEMA's update costs next to a training step, on CPU ranks (DDP and VitScaleStrategy).

Usage::

    python benchmarks/ema_cost.py                  # 2 ranks, 30 steps each strategy; prints a Markdown table
    python benchmarks/ema_cost.py --steps 40 --ranks 2

Model: ``lightning_vitscale.cli.demo.TinyViT(image=32, patch=4, dim=256, depth=6)`` (64 tokens), batch 8 per rank,
AdamW, fp32. Every rank times each step (``on_train_batch_start`` to the end of the EMA update) and the EMA update
itself (the ``ShardedEMA.on_train_batch_end`` hook: decay, foreach update of the local shards); the table reports
medians over steps 6..N (the first steps warm up allocators and FSDP's lazy init), largest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.ports import free_port  # noqa: E402 - after the checkout is importable

WARMUP = 5


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT))
    from lightning_vitscale import ShardedEMA, VitScaleStrategy
    from lightning_vitscale.cli.demo import TinyViT, generated_images

    class Timed(ShardedEMA):
        def __init__(self) -> None:
            super().__init__(decay=0.999, evaluate="raw")
            self.step_s: list[float] = []
            self.update_s: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            before = time.perf_counter()
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            end = time.perf_counter()
            self.update_s.append(end - before)
            self.step_s.append(end - self.start)

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = TinyViT(image=32, patch=4, dim=256, depth=6)
    strategy = "ddp" if args.strategy == "ddp" else VitScaleStrategy()
    ema = Timed()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, precision="32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[ema],
    )
    trainer.fit(model, DataLoader(generated_images(n=8 * world * args.steps), batch_size=8))
    row = [statistics.median(ema.step_s[WARMUP:]), statistics.median(ema.update_s[WARMUP:])]
    gathered = trainer.strategy.all_gather(torch.tensor(row, dtype=torch.float64)).reshape(world, -1).tolist()
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps(gathered))
    # The strategy destroys the process group at exit (distributed/teardown.py): gloo left to exit can abort.


def launch(strategy: str, ranks: int, steps: int, timeout: float) -> list[list[float]]:
    out = HERE / f".ema_cost_{strategy}_{ranks}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0", str(Path(__file__)),
        "--worker", f"--strategy={strategy}", f"--steps={steps}", f"--out={out}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"{strategy} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=["ddp", "vitscale"], default="vitscale", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    lines = ["| strategy | ranks | step ms (median) | EMA update ms (median) | update / step |"]
    lines.append("|---|---|---|---|---|")
    for strategy in ("ddp", "vitscale"):
        rows = launch(strategy, args.ranks, args.steps, args.timeout)
        step, update = max(r[0] for r in rows), max(r[1] for r in rows)
        lines.append(f"| {strategy} | {args.ranks} | {step * 1e3:.1f} | {update * 1e3:.2f} | {update / step:.2%} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
