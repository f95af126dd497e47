"""A structural key, so that identical blocks are measured once per process (most of the planner's setup time).

Blocks of one class can run different code (ViTDet's ``window_size`` 14 in most blocks, 0 in a few; a drop-path
rate of 0 skips an op), so the key holds each submodule's class and ``forward`` (patched: measured anew), mode, hook
counts and plain attributes besides parameter and buffer shapes. Floats count only as zero or not: rates and scales
change no op unless zero, and a drop-path growing block by block would otherwise be measured block by block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import hook_counts
from lightning_vitscale.discovery.calls import TensorSpec

_PLAIN = (bool, int, str, type(None))


def block_key(block: nn.Module, arguments: Any) -> Hashable:
    """Equal for two blocks (with their arguments: tensors as ``TensorSpec``) that run the same ops on the same
    shapes."""
    modules = tuple(
        (name, type(m), type(m).forward, m.training, hook_counts(m), _attributes(m),
         tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False)),
         tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False)))
        for name, m in block.named_modules()
    )
    return modules, _value_key(arguments)


def _attributes(module: nn.Module) -> tuple[tuple[str, Hashable], ...]:
    return tuple(sorted((k, _value_key(v)) for k, v in vars(module).items()
                        if not k.startswith("_") and k != "training" and not isinstance(v, nn.Module)))


def _value_key(value: Any) -> Hashable:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, float):
        return "zero" if value == 0 else ("float" if math.isfinite(value) else repr(value))
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_value_key(v) for v in value)
    if isinstance(value, dict):
        return "dict", tuple(sorted((str(k), _value_key(v)) for k, v in value.items()))
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, functools.partial):  # e.g. an activation with its approximation bound
        return "partial", _value_key(value.func), _value_key(list(value.args)), _value_key(value.keywords)
    if callable(value):
        return "callable", getattr(value, "__module__", None), getattr(value, "__qualname__", type(value).__qualname__)
    return "object", type(value).__qualname__
