"""Gradient accumulation without a reduce-scatter per micro-batch, when memory allows: the choice.

DDP all-reduces once per optimizer step; FSDP2 can too (``set_requires_gradient_sync(False)``), but then every rank
keeps the whole model's *unsharded* gradients between micro-batches. ``accumulation="auto"`` takes that only where
it fits; ``sharding/gradient_sync.py`` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_vitscale._utils import human_bytes

AccumulationMode = Literal["auto", "sharded", "unsharded"]
ACCUMULATION_MODES: tuple[str, ...] = ("auto", "sharded", "unsharded")


@dataclass(frozen=True)
class AccumulationChoice:
    """Whether micro-batches before the last keep unsharded gradients (``unsharded``) and why."""

    unsharded: bool
    reason: str

    def describe(self) -> str:
        how = "one reduce-scatter per optimizer step" if self.unsharded else "a reduce-scatter per micro-batch"
        return f"gradient accumulation: {how} ({self.reason})"


def choose_accumulation(mode: AccumulationMode, extra_bytes: int, in_use: int, budget: int) -> AccumulationChoice:
    """``"auto"``: unsharded where ``in_use`` (the step's peak) plus ``extra_bytes`` (unsharded gradients) fit."""
    if mode == "unsharded":
        return AccumulationChoice(True, "accumulation='unsharded'")
    if mode == "sharded":
        return AccumulationChoice(False, "accumulation='sharded'")
    fits = in_use + extra_bytes <= budget
    return AccumulationChoice(fits, f"auto: {human_bytes(extra_bytes)} of unsharded gradients on top of"
                              f" {human_bytes(in_use)} {'fits' if fits else 'does not fit'} in {human_bytes(budget)}")
