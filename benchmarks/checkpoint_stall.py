"""How long a sharded save stalls the training step, synchronous vs ``VitScaleStrategy(async_save=True)``.

Usage::

    python benchmarks/checkpoint_stall.py            # 2 ranks; prints a Markdown table
    python benchmarks/checkpoint_stall.py --rounds 2 --dim 2048 --depth 12

Model: ``depth`` blocks of ``Linear(dim, dim) + GELU`` (dim 2048, depth 12: 50M parameters, 201 MB fp32; with
AdamW's two moments a checkpoint holds 604 MB), batch 8 per rank, fp32. ``ModelCheckpoint(every_n_train_steps=5)``
saves a sharded folder; every rank times each step from ``on_train_batch_start`` to the next one (the save runs in
``on_train_batch_end``). The stall is the median step with a save minus the median step without one, largest rank.
Sync and async fits alternate in one launch (``--rounds`` each), so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.ports import free_port  # noqa: E402 - after the checkout is importable

EVERY = 5


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    from lightning_vitscale import VitScaleStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results: dict[str, list[list[float]]] = {"sync": [], "async": []}
    for _ in range(args.rounds):
        for mode in ("sync", "async"):
            L.seed_everything(0, verbose=False)
            clock, folder = _clock(), Path(args.dir or tempfile.gettempdir()) / f"stall_{mode}"
            checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=EVERY, save_top_k=-1)
            trainer = L.Trainer(
                accelerator="cpu", devices=world, strategy=VitScaleStrategy(async_save=mode == "async"),
                max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[clock, checkpoint],
            )
            start = time.perf_counter()
            trainer.fit(_model(args), DataLoader(TensorDataset(torch.randn(8 * args.steps, args.dim)), batch_size=8))
            total = time.perf_counter() - start
            row = [*_medians(clock.starts), total]
            gathered = trainer.strategy.all_gather(torch.tensor(row, dtype=torch.float64)).reshape(world, -1)
            results[mode].append(gathered.max(dim=0).values.tolist())
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                shutil.rmtree(folder, ignore_errors=True)  # 3 saves of 604 MB per fit
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results))


def _model(args: argparse.Namespace):
    import lightning as L
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.fc = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.nn.functional.gelu(self.fc(x))

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block(args.dim) for _ in range(args.depth)])

        def training_step(self, batch, batch_idx):
            return self.blocks(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Model()


def _clock():
    import lightning as L

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            self.starts.append(time.perf_counter())

    return Clock()


def _medians(starts: list[float]) -> tuple[float, float]:
    """Median step with a save (the save runs at the end of every EVERY-th step), median step without one (the
    first two steps warm up)."""
    steps = [b - a for a, b in zip(starts, starts[1:])]
    saving = [s for i, s in enumerate(steps) if (i + 1) % EVERY == 0]
    plain = [s for i, s in enumerate(steps) if (i + 1) % EVERY and i >= 2]
    return statistics.median(saving), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temp folder)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    out = HERE / ".checkpoint_stall.json"
    out.unlink(missing_ok=True)
    options = [f"--steps={args.steps}", f"--rounds={args.rounds}", f"--dim={args.dim}", f"--depth={args.depth}"]
    options += [f"--dir={args.dir}"] if args.dir else []
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0", str(Path(__file__)),
        "--worker", f"--out={out}", *options,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, start_new_session=True)
    if proc.returncode or not out.exists():
        raise SystemExit(f"exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    results = json.loads(out.read_text())
    out.unlink()
    lines = ["| save | round | step with a save, ms | step without, ms | stall, ms | fit total, s |"]
    lines.append("|---|---|---|---|---|---|")
    for mode in ("sync", "async"):
        for i, (saving, plain, total) in enumerate(results[mode]):
            stall = (saving - plain) * 1e3
            lines.append(f"| {mode} | {i + 1} | {saving * 1e3:.0f} | {plain * 1e3:.0f} | {stall:.0f} | {total:.1f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
