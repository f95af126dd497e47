"""Exact per-rank accounting of parameter, gradient and optimizer-state bytes (local shards, not peak RSS)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_vitscale._utils import full_bytes, local_bytes


@dataclass(frozen=True)
class StateBytes:
    """Local and unsharded bytes of parameters, gradients and optimizer state on one rank."""

    params_local: int
    params_full: int
    grads_local: int
    grads_full: int
    optimizer_local: int
    optimizer_full: int

    @property
    def sharded_fraction(self) -> float:
        """Local share of parameters and optimizer state: ~1/world_size when sharding works."""
        full = self.params_full + self.optimizer_full
        return (self.params_local + self.optimizer_local) / full if full else 1.0


def measure_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> StateBytes:
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [value for optimizer in optimizers for state in optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor) and value.dim() > 0]
    return StateBytes(
        params_local=local_bytes(params),
        params_full=full_bytes(params),
        grads_local=local_bytes(grads),
        grads_full=full_bytes(grads),
        optimizer_local=local_bytes(states),
        optimizer_full=full_bytes(states),
    )
