"""Blocks run in an order other than the one they were registered in (a stack walked back, two halves interleaved)
on 2 CPU ranks: DDP against ``VitScaleStrategy(priority="memory")`` (every block its own unit, resharded after
forward), each rank's last loss, the block units still holding an issued all-gather when the head starts (gathered
ahead, not yet used), and the growth of the tensor bytes alive from a training step's start to their most at any
block's start.

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/call_order_units.py OUT [--dim 256 --depth 8 --steps 4]

writes ``OUT`` (rank 0's JSON); ``benchmarks/RESULTS.md`` has a run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from tests.helpers.peak import live_tensor_bytes
from tests.helpers.tiny_vit_module import TinyViTModule

ORDERS = {"registered": lambda n: list(range(n)), "reversed": lambda n: list(range(n))[::-1],
          "interleaved": lambda n: [i for pair in zip(range(n // 2), range(n // 2, n)) for i in pair]}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, order: list[int]) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(16, dim), nn.Linear(dim, 10)
        self.blocks = nn.ModuleList(Block(dim) for _ in order)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index in self.order:
            x = self.blocks[index](x)
        return self.head(x.mean(1))


class Measured(TinyViTModule):
    """The habit tests' module (its step, loss and SGD at lr 0.05) on :class:`Net`."""

    def __init__(self, dim: int, order: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(dim, order)
        self.held: list[int] = []
        self.growth: list[int] = []
        self.start = 0
        for block in self.net.blocks:
            block.register_forward_pre_hook(self._live)
        self.net.head.register_forward_pre_hook(self._held)

    def _live(self, *_) -> None:
        if self.training and self.growth:
            self.growth[-1] = max(self.growth[-1], live_tensor_bytes() - self.start)

    def _held(self, *_) -> None:
        """Block units whose all-gather was issued and not yet taken by their forward (FSDP2 keeps its result on the
        unit's parameter group until the unit's next pre-forward or pre-backward)."""
        units = [b._get_fsdp_state() for b in self.net.blocks if hasattr(b, "_get_fsdp_state")]
        if self.training and units:
            self.held.append(sum(getattr(u._fsdp_param_group, "_all_gather_result", None) is not None for u in units))

    def on_train_batch_start(self, batch, batch_idx) -> None:
        gc.collect()
        self.start = live_tensor_bytes()
        self.growth.append(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8 * args.steps, 8, 16, generator=generator),
                         torch.randint(0, 10, (8 * args.steps,), generator=generator))
    rows = {}
    for name, order in ORDERS.items():
        for key, strategy in (("ddp", lambda: "ddp"), ("vitscale", lambda: VitScaleStrategy(priority="memory"))):
            model = Measured(args.dim, order(args.depth))
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy(), max_steps=args.steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(model, DataLoader(data, batch_size=4))
            rows[f"{name}/{key}"] = {"last_loss": model.losses[-1], "held_at_head": model.held,
                                     "growth_mib": [round(b / 2**20, 2) for b in model.growth]}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as file:
            json.dump({"torch": torch.__version__, "lightning": L.__version__, "args": vars(args), "rows": rows}, file,
                      indent=1)
        for name, row in rows.items():
            print(f"{name:24s} loss {row['last_loss']:.6f}  held {row['held_at_head']}  growth MiB {row['growth_mib']}")


if __name__ == "__main__":
    main()
