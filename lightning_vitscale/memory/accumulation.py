"""Gradient accumulation without a reduce-scatter per micro-batch, when memory allows: the choice.

Under DDP, ``accumulate_grad_batches=k`` all-reduces once per optimizer step (Lightning wraps the first k-1
micro-batches in ``no_sync``). FSDP2 can do the same (``set_requires_gradient_sync(False)``), but then every rank
keeps the *unsharded* gradients of every unit between micro-batches: the whole model's gradients in the compute
dtype instead of 1/world of them. ``accumulation="auto"`` takes that only where it fits; this module says whether
it does, the sharding setup applies it (``sharding/gradient_sync.py``).
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
    """``"unsharded"``/``"sharded"`` as asked; ``"auto"``: unsharded when ``in_use`` (the step's predicted or
    measured peak) plus ``extra_bytes`` (the unsharded gradients beyond this rank's shards) stays within
    ``budget`` (bytes: ``memory_budget`` as setup resolved it)."""
    if mode == "unsharded":
        return AccumulationChoice(True, "accumulation='unsharded'")
    if mode == "sharded":
        return AccumulationChoice(False, "accumulation='sharded'")
    need = in_use + extra_bytes
    fits = need <= budget
    verdict = "fits" if fits else "does not fit"
    return AccumulationChoice(
        fits, f"auto: {human_bytes(extra_bytes)} of unsharded gradients on top of {human_bytes(in_use)} {verdict}"
        f" in {human_bytes(budget)}"
    )
