"""A meta-device twin of a module, to measure on fake tensors without touching the real one, and its caches."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_vitscale._utils import derived_attributes, private_copy, trainer_of


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors (meta stand-ins in ``deepcopy``'s memo: no
    parameter is copied); a LightningModule's device mesh and Fabric are shared."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    for tensor in derived_attributes(module):  # recomputed from the parameters before use (old weight_norm)
        memo[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    for value in (module.__dict__.get(name) for name in ("_device_mesh", "_fabric", "_metric_attributes")):
        if value is not None:
            memo[id(value)] = value
    twin = private_copy(module, memo)
    if isinstance(twin, LightningModule) and twin.fabric is None:  # a Fabric's shim stands for the Trainer
        # __getstate__ dropped the Trainer: a training_step measured on the twin may read self.trainer (none where no
        # Trainer holds the module: plan_memory, the CLI's plan).
        twin.trainer = trainer_of(module)
    return twin


REAL_VALUES_LIMIT = 4 * 2**30
"""The most parameter and buffer bytes the planner copies to the host to run a step on real values (a 1B-parameter
model in fp32): the copy, its gradients and the step's activations are host memory."""


def real_values(twin: nn.Module, module: nn.Module) -> dict[int, torch.Tensor] | None:
    """``module``'s parameters and buffers by ``id`` of ``twin``'s (its :func:`meta_twin`, or itself), or ``None``
    where they hold no value to run on (meta, sharded, fake) or would take more than :data:`REAL_VALUES_LIMIT`."""
    pairs = list(zip([*twin.parameters(), *twin.buffers()], [*module.parameters(), *module.buffers()], strict=True))
    plain = (torch.Tensor, nn.Parameter)
    if any(type(real) not in plain or real.is_meta for _, real in pairs):  # a DTensor, a FakeTensor, a meta tensor
        return None
    if sum(real.numel() * real.element_size() for _, real in pairs) > REAL_VALUES_LIMIT:
        return None
    return {id(tensor): real for tensor, real in pairs}


_LRU_CACHE = type(functools.lru_cache(lambda: None))


@contextlib.contextmanager
def fresh_caches(model: nn.Module) -> Iterator[None]:
    """Empty the ``lru_cache`` s of ``model``'s code around a fake-tensor run: a real entry would meet fake tensors, a
    fake one the real step (HF BEiT caches its relative position index per window size, and failed)."""
    caches = _lru_caches(model)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for cache in caches:
            cache.cache_clear()


def _lru_caches(model: nn.Module) -> list[Any]:
    """The caches in ``model``'s classes, their modules and closures (HF's ``compile_compatible_method_lru_cache``)."""
    classes = {cls for module in model.modules() for cls in type(module).__mro__ if cls.__module__ != "builtins"}
    spaces = [vars(cls) for cls in classes] + [vars(m) for m in {sys.modules.get(c.__module__) for c in classes} if m]
    found = {}
    for value in (value for space in spaces for value in list(space.values())):
        function = getattr(value, "__func__", value)  # staticmethod / classmethod
        cells = [cell.cell_contents for cell in getattr(function, "__closure__", None) or () if _filled(cell)]
        found.update({id(c): c for c in (function, *cells) if isinstance(c, _LRU_CACHE)})
    return list(found.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
