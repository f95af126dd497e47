"""When two blocks cost the same: a structural key, so that identical blocks are measured once.

A ViT's blocks are one class repeated with the same shapes, and measuring each on fake tensors repeats the same
dispatch work (most of the planner's setup time). But blocks of one class can run different code: ViTDet keeps
``window_size`` 14 in most blocks and 0 (global attention) in a few, with the same parameters; a drop-path rate
of 0 skips the op that a positive one runs. So the key holds each submodule's type, train/eval mode, hook counts
and plain attributes (ints, strings, bools, dtypes, callables by name) besides parameter and buffer shapes.
Floats count only as zero or not: rates and scales (dropout ``p``, drop-path, ``eps``, layer-scale init) change
neither shapes nor the ops that run unless they are zero, and a model whose drop-path grows block by block would
otherwise be measured block by block.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import hook_counts

_PLAIN = (bool, int, str, type(None))


def block_key(block: nn.Module, x: torch.Tensor) -> Hashable:
    """Equal for two blocks (with their inputs) that run the same ops on the same shapes."""
    modules = tuple(
        (name, type(m).__qualname__, m.training, hook_counts(m), _attributes(m),
         tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False)),
         tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False)))
        for name, m in block.named_modules()
    )
    return type(block), modules, tuple(x.shape), x.dtype


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
    if callable(value):
        return "callable", getattr(value, "__module__", None), getattr(value, "__qualname__", type(value).__qualname__)
    return "object", type(value).__qualname__
