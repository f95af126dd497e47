"""Full (gathered) copies of a model's weights and optimizer state, for bit-for-bit comparisons in rank scripts."""

from __future__ import annotations

import lightning as L
import torch
from torch.distributed.tensor import DTensor


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached full copy; for a DTensor a collective every rank must join."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model: torch.nn.Module, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Weights (``w.<name>``) and the first optimizer's state (``o.<name>.<key>``), gathered on every rank."""
    out = {f"w.{n}": full(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in trainer.optimizers[0].state.items():
        out.update({f"o.{names[id(p)]}.{k}": full(v) for k, v in s.items() if torch.is_tensor(v)})
    return out
