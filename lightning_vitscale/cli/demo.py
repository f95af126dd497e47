"""`python -m lightning_vitscale demo`: the same small ViT trained with DDP and with VitScaleStrategy, side by side."""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal, get_args

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale._utils import MIB
from lightning_vitscale.memory import measure_state_bytes
from lightning_vitscale.strategy import VitScaleStrategy


class Block(nn.Module):
    """Pre-norm transformer block with fused attention (SDPA)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TinyViT(L.LightningModule):
    """A plain single-device LightningModule: nothing in it knows about sharding."""

    def __init__(self, image: int = 32, patch: int = 4, dim: int = 128, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, 8) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def generated_images(n: int = 2048, classes: int = 10, image: int = 32, seed: int = 0) -> TensorDataset:
    """Each class is a fixed random template plus noise: learnable in a few steps, no download."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, 3, image, image, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(templates[labels] + 1.5 * torch.randn(n, 3, image, image, generator=g), labels)


DemoPrecision = Literal["32-true", "bf16-mixed", "bf16-true"]  # the `demo --precision` choices


@dataclass
class RunResult:
    name: str
    losses: list[float]
    bytes_per_rank: list[int]
    seconds: float


def train(strategy, accelerator: str, devices: int | str, steps: int, precision: DemoPrecision) -> RunResult:
    L.seed_everything(0, verbose=False)
    model = TinyViT()
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, DataLoader(generated_images(), batch_size=16))
    seconds = time.perf_counter() - start
    state = measure_state_bytes(model, trainer.optimizers)
    local = torch.tensor([state.params_local + state.grads_local + state.optimizer_local], device=model.device)
    per_rank = trainer.strategy.all_gather(local).flatten().tolist()
    name = type(trainer.strategy).__name__
    return RunResult(name, model.losses, [int(b) for b in per_rank], seconds)


def format_table(ddp: RunResult, ours: RunResult) -> str:
    lines = [f"{'step':>4}  {'DDP loss':>10}  {'VitScale loss':>13}  {'rel. diff':>9}"]
    for step, (a, b) in enumerate(zip(ddp.losses, ours.losses)):
        lines.append(f"{step:>4}  {a:>10.5f}  {b:>13.5f}  {abs(a - b) / max(abs(a), 1e-12):>9.1e}")
    lines.append("")
    lines.append("param + grad + optimizer bytes held per rank:")
    for rank, (a, b) in enumerate(zip(ddp.bytes_per_rank, ours.bytes_per_rank)):
        lines.append(f"  rank {rank}: DDP {a / MIB:8.2f} MiB   VitScale {b / MIB:8.2f} MiB   ({b / a:.2f}x)")
    lines.append(
        f"wall time of fit(): DDP {ddp.seconds:.1f} s (includes starting the other ranks),"
        f" VitScale {ours.seconds:.1f} s"
    )
    return "\n".join(lines)


def demo_command_parser(subparsers: Any) -> None:
    demo = subparsers.add_parser("demo", help="train a small ViT with DDP and with VitScaleStrategy and compare")
    demo.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    demo.add_argument("--devices", type=int, default=None, help="processes (default: all GPUs, or 2 on CPU)")
    demo.add_argument("--steps", type=int, default=10)
    demo.add_argument("--precision", default="32-true", choices=get_args(DemoPrecision))
    demo.set_defaults(command=demo_command)


def demo_command(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.devices or (torch.cuda.device_count() if accelerator == "cuda" else 2)
    ddp = train("ddp", accelerator, n, args.steps, args.precision)
    ours = train(VitScaleStrategy(), accelerator, n, args.steps, args.precision)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
        print("\n" + format_table(ddp, ours))
    return 0
