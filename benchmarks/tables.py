"""Model FLOPs, MFU and the Markdown tables of the GPU benchmark: one formula and one layout for every row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

MFU_FORMULA = (
    "MFU = (3 x forward FLOPs per image) x images/s / peak dense bf16 FLOP/s. Forward FLOPs are counted once per"
    " model with `torch.utils.flop_counter.FlopCounterMode` on the plain model (meta device, batch 1); 3x covers"
    " forward + backward. Activation-checkpointing recompute and the optimizer step are not counted, so every row"
    " of a model is credited the same work per image."
)


def train_flops_per_sample(build: Callable[[], nn.Module], sample_shape: Sequence[int]) -> float:
    """3 x the forward FLOPs of one sample, counted on the meta device (no memory, no kernels run)."""
    with torch.device("meta"):
        model = build()
        x = torch.empty(1, *sample_shape)
    with FlopCounterMode(display=False) as counter:
        model(x)
    return 3.0 * counter.get_total_flops()


def mfu(flops_per_sample: float, samples_per_sec: float, peak_flops: float | None) -> float | None:
    return None if not peak_flops else flops_per_sample * samples_per_sec / peak_flops


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; ``None`` cells print as ``-``."""
    cells = [[("-" if value is None else str(value)) for value in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells for {len(headers)} headers")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def fmt(value: float | None, spec: str = ".1f", scale: float = 1.0, suffix: str = "") -> str | None:
    return None if value is None else f"{value * scale:{spec}}{suffix}"
