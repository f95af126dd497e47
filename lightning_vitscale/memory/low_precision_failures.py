"""Layers whose own code needs fp32 weights under O2, found by the step the planner runs and kept in fp32 beside the
norms, as DDP's AMP keeps every weight.

DDP's AMP holds fp32 weights and casts at each matmul; O2 hands each layer its weights in bf16. Code written for the
former breaks on the latter where a layer computes with its weight itself: GFNet's global filter takes
``torch.view_as_complex`` of its weight ("only supported for half, float and double tensors, but got ... BFloat16"),
FourCastNet's AFNO multiplies its fp32 spectrum (``x.float()`` on purpose) by its weights in an einsum ("expected m1
and m2 to have the same dtype, but got: float != c10::BFloat16"). Where the planner's run of the step raises so, the
innermost module running that holds parameters is kept in fp32, with the same layer of every other block, and the
step measured again: at most :data:`LIMIT` times, never the model itself, a block or a module
holding one (those stay sharded in the compute dtype), and only for an error that names the compute dtype (any other
failure is the caller's: a branch on a value falls back to real values).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

from torch import nn

from lightning_vitscale.discovery import parameter_holder
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.precision import PrecisionPolicy
from lightning_vitscale.precision.fp32_fix import names_dtype

T = TypeVar("T")
LIMIT = 8
"""The most runs of the step, each keeping one more class of modules in fp32: a model failing in more is not this
case."""


def measure_keeping_fp32(
    measure: Callable[[PrecisionPolicy], T], record: Calls, model: nn.Module, policy: PrecisionPolicy,
    blocks: Collection[str],
) -> T:
    """``measure(policy)``, again with each module that raised in the compute dtype kept in fp32 (their names and
    torch's errors in ``record.kept_fp32``); the last error where that does not help."""
    kept: dict[str, str] = {}
    while True:
        try:
            measured = measure(policy.keeping_fp32(kept))
        except Exception as error:
            name = _needing_fp32(model, record, policy, kept, blocks, error)
            if name is None:
                raise
            why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            kept.update(dict.fromkeys(_alike(model, name, blocks), why))  # each block's: one more run, not one each
            record.clear()
            continue
        record.kept_fp32.update(kept)
        return measured


def _needing_fp32(
    model: nn.Module, record: Calls, policy: PrecisionPolicy, kept: Collection[str], blocks: Collection[str],
    error: Exception,
) -> str | None:
    """The module to keep in fp32 for ``error``, or ``None``: not a failure of the compute dtype's weights."""
    classes = {type(model.get_submodule(name)) for name in kept}
    if len(classes) >= LIMIT or not names_dtype(error, policy.compute):
        return None
    if policy.keeping_fp32({""}) is policy:  # nothing can be kept in fp32 under this policy ("bf16-true")
        return None
    name = parameter_holder(model, record.where)
    if not name or name in kept or any(block == name or block.startswith(f"{name}.") for block in blocks):
        return None
    return name


def _alike(model: nn.Module, name: str, blocks: Collection[str]) -> list[str]:
    """``name`` and, inside a block, the same layer of every other block (the same path below it, of the same
    class): one more run of the step for all of them. Never every module of a class: a torch layer's class (an
    ``nn.Linear``) is in every block, in fp32 it would be the whole model."""
    block = next((b for b in blocks if name.startswith(f"{b}.")), None)
    if block is None:
        return [name]
    below, kind = name[len(block) + 1:], type(model.get_submodule(name))
    found = []
    for other in blocks:
        try:
            module = model.get_submodule(f"{other}.{below}")
        except AttributeError:
            continue
        if type(module) is kind:
            found.append(f"{other}.{below}")
    return found or [name]
