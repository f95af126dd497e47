"""Rank script: a model that skips whole blocks in some training steps (LayerDrop), as DDP's
``find_unused_parameters=True`` trains it and as ``VitScaleStrategy(find_unused_parameters=True)`` must.

``skipped_blocks.py OUT name1,name2``: each scenario ``<config>/<strategy>`` (``CONFIGS``) trains 4 steps with the
same weights and data and records this rank's losses and the final weights' sums. Schedules: ``per_rank``, rank r
skips block (step + r) % 4 (each rank one block per step, a different one, so the ranks' collectives would line up
in count and pair wrong blocks); ``uneven``, rank 0 skips block step % 4 and rank 1 none; ``same``, every rank skips
block 3 always (AdamW must leave it untouched, as DDP leaves a parameter no rank used without a gradient) and block
step % 3.

``skipped_blocks.py OUT refuse PRIORITY``, under Lightning's own launcher, ``find_unused_parameters=False``: rank 1
skips block 1 from the second step while rank 0 runs all four. Rank 1 must raise ``SkippedBlocksError`` before that
backward sends anything, and the job must end at once, not when rank 0's collective times out.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import CLASSES, loader
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
DEPTH, DIM, PATCH = 4, 32, 8


class LayerDropNet(L.LightningModule):
    """Patch embedding, 4 encoder blocks of which the schedule skips some per training step, a head."""

    def __init__(self, schedule: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.schedule = schedule
        self.embed = nn.Conv2d(3, DIM, PATCH, PATCH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 4, DIM * 2, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(DEPTH)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.step_index = self.pass_index = 0
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        if schedule == "first":
            self.embed.requires_grad_(False)

    def skipped(self) -> set[int]:
        rank, step = self.global_rank, self.step_index
        if self.schedule == "per_rank":
            return {(step + rank) % DEPTH}
        if self.schedule == "uneven":  # rank 0 skips block step % 4, rank 1 none: the ranks' unused counts differ
            return {step % DEPTH} if rank == 0 else set()
        if self.schedule == "one_rank":  # rank 1 skips block 1 from the second step; rank 0 runs every block
            return {1} if rank == 1 and step >= 1 else set()
        if self.schedule == "last":  # rank 1 skips the last block (and one more, in turn): stood in for on the loss
            return {DEPTH - 1, step % (DEPTH - 1)} if rank == 1 else set()
        if self.schedule == "first":  # the first block after a frozen stem (no gradient into it), one rank a step
            return {0} if (step + rank) % 2 == 0 else set()
        if self.schedule == "two_pass":  # two forwards a step (a second crop); rank 1's first ends early
            return {(step + rank + self.pass_index) % DEPTH} | ({DEPTH - 1} if rank == 1 and not self.pass_index
                                                                 else set())
        return {DEPTH - 1, step % (DEPTH - 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            skipped = self.skipped()
        else:  # "last" also skips in evaluation, rank 1 the last block: stood in for when the call ends
            skipped = {DEPTH - 1} if self.schedule == "last" and self.global_rank == 1 else set()
        x = self.embed(x).flatten(2).transpose(1, 2)
        for index, block in enumerate(self.blocks):
            if index not in skipped:
                x = block(x)
        return self.head(self.norm(x).mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.schedule == "two_pass":  # the images, then a crop of them: each forward skips its own blocks
            self.pass_index = 0
            first = F.cross_entropy(self(x), y)
            self.pass_index = 1
            loss = first + F.cross_entropy(self(x[..., :16, :16]), y)
        else:
            loss = F.cross_entropy(self(x), y)
        self.step_index += 1
        self.losses.append(loss.item())
        if self.schedule == "last":  # a collective of the user's between the ranks' gathers of the last block
            self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class Experts(nn.Module):
    """A block with three expert MLPs, of which the caller picks one (mixture-of-experts routing, simplified)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return x + self.experts[expert](self.norm(x))


class ExpertsNet(LayerDropNet):
    """Every block runs on every rank, each with the expert (rank + block + step) % 2: the ranks use different
    parameters inside the same units, and expert 2 is never used."""

    def __init__(self, schedule: str) -> None:
        super().__init__(schedule)
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(Experts() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        for index, block in enumerate(self.blocks):
            x = block(x, (self.global_rank + index + self.step_index) % 2)
        return self.head(self.norm(x).mean(1))


def fit(schedule: str, strategy, steps: int = 4, **trainer_kwargs) -> tuple[LayerDropNet, L.Trainer]:
    model = ExpertsNet(schedule) if schedule == "experts" else LayerDropNet(schedule)
    trainer_kwargs = {"limit_val_batches": 0, "num_sanity_val_steps": 0, **trainer_kwargs}
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 2)), strategy=strategy, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )
    validating = trainer_kwargs["limit_val_batches"] != 0
    trainer.fit(model, loader(n=64, batch_size=4), loader(n=16, batch_size=4) if validating else None)
    return model, trainer


# Each config's schedule and Trainer settings. "accum2": 2 micro-batches per optimizer step, each skipping its own
# blocks (a parameter unused in one micro-batch but used in the other must keep its gradient); "uneven_bf16": the
# fp32 norms are replicated outside FSDP and all-reduce their own gradients, and rank 0 lacks two of them per step
# where rank 1 lacks none (with equal counts, as "per_rank" has, a missing zero-fill pairs wrong norms silently).
# "experts": ExpertsNet under VitScaleStrategy without the flag, as it comes (the 4 blocks in one unit here) and
# with every block its own unit: no block is skipped, so none is refused, and the experts the ranks leave unused
# are reduced as zeros (before, the ranks' reduce-scatters held different experts of equal size: silently wrong
# gradients).
SKIPPABLE = {"find_unused_parameters": True, "priority": "memory"}
UNITS = {"find_unused_parameters": "units", "priority": "memory"}  # the blocks stay units: skipped ones stood in for
CONFIGS = {
    "per_rank": ("per_rank", {}, SKIPPABLE),
    "same": ("same", {}, SKIPPABLE),
    "per_rank_accum2": ("per_rank", {"accumulate_grad_batches": 2}, SKIPPABLE),
    "same_accum2": ("same", {"accumulate_grad_batches": 2}, SKIPPABLE),
    "uneven_bf16": ("uneven", {"precision": "bf16-mixed"}, SKIPPABLE),
    "per_rank_units": ("per_rank", {}, UNITS),
    "per_rank_speed": ("per_rank", {}, {"find_unused_parameters": "units"}),
    "accum2_units": ("per_rank", {"accumulate_grad_batches": 2}, UNITS),
    "last": ("last", {"limit_val_batches": 2, "val_check_interval": 2}, UNITS),
    "first": ("first", {}, UNITS),
    "two_pass": ("two_pass", {}, UNITS),
    "experts": ("experts", {}, {}),
    "experts_units": ("experts", {}, {"priority": "memory"}),
}


def scenario(config: str, strategy_name: str) -> dict:
    schedule, trainer_kwargs, options = CONFIGS[config]
    strategy = "ddp_find_unused_parameters_true" if strategy_name == "ddp" else VitScaleStrategy(**options)
    model, trainer = fit(schedule, strategy, **trainer_kwargs)
    facts: dict = {
        "losses": model.losses,
        "weights": {name: float(value.double().sum()) for name, value in model.state_dict().items()},
        "val_losses": model.val_losses,
    }
    if strategy_name == "vitscale":
        facts["block_units"] = sum(isinstance(block, FSDPModule) for block in model.blocks)
        facts["summary"] = trainer.strategy.plan.summary()
        stand_ins = trainer.strategy.sharded.stand_ins
        facts["stood_in"] = stand_ins.stood_in if stand_ins is not None else None
    return facts


def refuse(priority: str) -> None:
    """Lightning's launcher starts rank 1; rank 1 skips a block rank 0 runs: SkippedBlocksError, job ends."""
    fit("one_rank", VitScaleStrategy(priority=priority))


if __name__ == "__main__":
    if sys.argv[2] == "refuse":
        refuse(sys.argv[3])
    else:
        run_scenarios({f"{config}/{name}": (lambda c=config, n=name: scenario(c, n))
                       for config in CONFIGS for name in ("ddp", "vitscale")})
