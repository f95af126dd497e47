"""A meta-device twin of a module: its structure without its data, for measuring on fake tensors without touching
the real module (the planning batch's ``training_step``, the tensor-parallel split of :mod:`.tensor_split`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors: structure without data.

    Tensors are mapped to meta stand-ins in ``deepcopy``'s memo, so no parameter is ever copied; anything the
    module refers to that is not its own (trainer, device mesh) is shared, not copied.
    """
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    shared = {name: module.__dict__.get(name) for name in ("_trainer", "_device_mesh", "_fabric", "_metric_attributes")}
    for value in shared.values():
        if value is not None:
            memo[id(value)] = value
    twin = copy.deepcopy(module, memo)
    # LightningModule.__getstate__ drops the trainer: put it back, the plan follows the Trainer's loop.
    twin.__dict__.update({name: value for name, value in shared.items() if value is not None})
    return twin
