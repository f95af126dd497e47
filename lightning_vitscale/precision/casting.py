"""The outer unit's layers (and blocks joined to it) cast floating inputs to the compute dtype, as FSDP does at each
unit's forward: under O2 they compute with bf16 parameters, and a tensor made in a step (a mask, noise) or passed by
hand reaches them in fp32 and fails ("Input type (float) and bias type (BFloat16)"), which autocast users never see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import tree_map


def to_dtype(dtype: torch.dtype | None) -> Callable[[Any], Any]:
    """The cast of one value: a floating tensor to ``dtype`` (``None``: unchanged), anything else as it is."""

    def cast(value: Any) -> Any:
        if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return cast


def cast_floating_inputs(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Register a forward pre-hook on each module casting floating tensor inputs to ``dtype``."""
    cast = to_dtype(dtype)

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        if all(isinstance(v, torch.Tensor) and (v.dtype == dtype or not v.is_floating_point())
               for v in (*args, *kwargs.values())):
            return None  # inside a step the activations come in the compute dtype: no tree walk (~20 us a call)
        return tree_map(cast, args), tree_map(cast, kwargs)

    for module in modules:
        module.register_forward_pre_hook(hook, with_kwargs=True)
