"""A LayerDrop ViT (blocks skipped per rank) on 2 CPU ranks: ``strategy="ddp_find_unused_parameters_true"`` against
``VitScaleStrategy(find_unused_parameters=True)`` (every block in the outer unit, gathered for the step) and
``find_unused_parameters="units"`` (the blocks in units, a skipped one stood in for: ``sharding/stand_ins.py``),
each under the default plan and ``priority="memory"``: each rank's losses, the median step, and the growth of the tensor
bytes alive from a training step's start to their most at any block's start in its forward (the gathered
parameters beside the activations; steps 3 on, every earlier case's tensors collected).

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/layerdrop_units.py OUT [--depth 8 --dim 384 --steps 8]

writes ``OUT.rank0`` and ``OUT.rank1`` (JSON); ``benchmarks/RESULTS.md`` has a run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from tests.helpers.peak import live_tensor_bytes


class LayerDropViT(L.LightningModule):
    """Patch embedding, ``depth`` pre-norm encoder blocks each skipped with probability ``drop`` in a training
    forward (drawn from this rank's own generator: the ranks skip different blocks), a linear head."""

    def __init__(self, depth: int, dim: int, drop: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)
        self.drop = drop
        self.draws: torch.Generator | None = None
        self.losses: list[float] = []
        self.step_seconds: list[float] = []
        self.peak_live = 0
        self.live_at_start = 0
        self._started = 0.0
        for block in self.blocks:
            block.register_forward_pre_hook(self._sample)

    def _sample(self, *unused: object) -> None:
        if self.training and torch.is_grad_enabled() and len(self.losses) >= 2:  # after warm-up
            self.peak_live = max(self.peak_live, live_tensor_bytes())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            if self.training and self.draws is not None and torch.rand((), generator=self.draws) < self.drop:
                continue
            x = block(x)
        return self.head(self.norm(x).mean(1))

    def on_train_start(self) -> None:
        self.draws = torch.Generator().manual_seed(100 + self.global_rank)

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if batch_idx == 2:  # the state as the measured steps find it: parameters, optimizer state, no activations
            gc.collect()
            self.live_at_start = live_tensor_bytes()
        self._started = time.perf_counter()

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.step_seconds.append(time.perf_counter() - self._started)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def run(name: str, strategy: object, args: argparse.Namespace) -> dict:
    gc.collect()  # the earlier cases' models and optimizers
    model = LayerDropViT(args.depth, args.dim, args.drop)
    g = torch.Generator().manual_seed(1)
    n = args.batch * args.steps * 2
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    plan = getattr(trainer.strategy, "plan", None)
    units = next((line.split(":", 1)[1].strip() for line in plan.summary().splitlines()
                  if "FSDP units" in line), "") if plan is not None else "DDP"
    return {"losses": model.losses, "step_ms": 1e3 * statistics.median(model.step_seconds[2:]),
            "step_growth_mib": (model.peak_live - model.live_at_start) / 2**20, "units": units}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--drop", type=float, default=0.3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cases = {
        "ddp": lambda: "ddp_find_unused_parameters_true",
        "outer": lambda: VitScaleStrategy(find_unused_parameters=True),
        "outer_memory": lambda: VitScaleStrategy(find_unused_parameters=True, priority="memory"),
        "units": lambda: VitScaleStrategy(find_unused_parameters="units"),
        "units_memory": lambda: VitScaleStrategy(find_unused_parameters="units", priority="memory"),
    }
    results = {name: run(name, make(), args) for name, make in cases.items()}
    rank = int(os.environ.get("RANK", 0))
    with open(f"{args.out}.rank{rank}", "w") as file:
        json.dump({"torch": torch.__version__, "lightning": L.__version__, "args": vars(args), **results}, file)


if __name__ == "__main__":
    main()
