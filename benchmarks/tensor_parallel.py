"""Step time and per-rank state of tensor parallelism beside FSDP against FSDP alone and DDP, on 4 CPU ranks.

The examples' ViT (fp32, no activation checkpointing) at the same global batch through ``Trainer.fit``: DDP,
``VitScaleStrategy()`` (FSDP=4) and ``VitScaleStrategy(tensor_parallel=2)`` (TP=2 x FSDP=2), interleaved round
by round so that the machine's load falls on all three alike; the median step after two warm-up steps, and
parameter + optimizer bytes per rank. Run under torch's launcher:

    torchrun --nproc-per-node=4 benchmarks/tensor_parallel.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples.models.vit import VisionTransformer  # noqa: E402
from lightning_vitscale import VitScaleStrategy, measure_state_bytes  # noqa: E402

STRATEGIES = ("ddp", "fsdp4", "tp2_fsdp2")
GLOBAL_BATCH = 16


class Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *_: object) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_: object) -> None:
        self.times.append(time.perf_counter() - self._start)


class Model(L.LightningModule):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.vit = VisionTransformer(32, 4, 3, 10, dim, 4, 8, mlp_ratio=4.0)  # 64 tokens, 4 blocks, 8 heads

    def training_step(self, batch, _):
        return F.cross_entropy(self.vit(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def run(name: str, dim: int, steps: int) -> tuple[float, int]:
    """Median step seconds after two warm-up steps, and this rank's parameter + optimizer bytes."""
    strategy = {"ddp": "ddp", "fsdp4": VitScaleStrategy(activation_checkpointing=False),
                "tp2_fsdp2": VitScaleStrategy(tensor_parallel=2, activation_checkpointing=False)}[name]
    per_rank = GLOBAL_BATCH // (2 if name == "tp2_fsdp2" else 4)
    n = GLOBAL_BATCH * steps
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    L.seed_everything(0, verbose=False)
    model, timer = Model(dim), Timer()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=per_rank))
    state = measure_state_bytes(model, trainer.optimizers)
    return statistics.median(timer.times[2:]), state.params_local + state.optimizer_local


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    state: dict[str, int] = {}
    for _ in range(args.rounds):
        for name in STRATEGIES:
            seconds, state[name] = run(name, args.dim, args.steps)
            times[name].append(seconds)
    if dist.get_rank() != 0:
        return
    ddp = statistics.median(times["ddp"])
    print(f"dim {args.dim}, 4 blocks, 64 tokens, global batch {GLOBAL_BATCH}, {args.rounds} interleaved rounds")
    print("| strategy | median step (s) | x DDP | param + optimizer bytes per rank | x DDP |")
    print("|---|---|---|---|---|")
    for name in STRATEGIES:
        step = statistics.median(times[name])
        mib, share = state[name] / 2**20, state[name] / state["ddp"]
        print(f"| {name} | {step:.3f} | {step / ddp:.2f} | {mib:.1f} MiB | {share:.2f} |")


if __name__ == "__main__":
    main()
