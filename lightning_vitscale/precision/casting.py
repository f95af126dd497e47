"""Casts that keep O2's bf16 compute from meeting an fp32 tensor that DDP's autocast would have cast at its use.

The outer unit's layers (and blocks joined to it) cast floating inputs to the compute dtype, as FSDP does at each
unit's forward: under O2 they compute with bf16 parameters, and a tensor made in a step (a mask, noise) or passed by
hand reaches them in fp32 and fails ("Input type (float) and bias type (BFloat16)"), which autocast users never see.
FSDP casts parameters, not buffers: unsaved ones take the compute dtype once, saved ones meet it under autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_vitscale._compat import (
    BatchNormBase,
    autocast_turned_off,
    buffer_slots,
    tree_map,
    unsaved_buffer_names,
)
from lightning_vitscale._utils import AUTOCAST_FLOOR


def to_dtype(dtype: torch.dtype | None) -> Callable[[Any], Any]:
    """The cast of one value: a floating tensor to ``dtype`` (``None``: unchanged), anything else as it is."""

    def cast(value: Any) -> Any:
        if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return cast


def first_floating_tensor(values: tuple[Any, ...]) -> torch.Tensor | None:
    """The first floating tensor among ``values`` (``None``: none)."""
    return next((v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def first_floating_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of a call's first floating tensor argument (``None``: none): what its output goes back to."""
    first = first_floating_tensor((*args, *kwargs.values()))
    return first.dtype if first is not None else None


def cast_floating_inputs(modules: list[tuple[str, nn.Module]], dtype: torch.dtype) -> None:
    """Register a forward pre-hook on each ``(name, module)`` casting floating tensor inputs to ``dtype``."""
    cast = to_dtype(dtype)
    warned: set[str] = set()

    def hook(name: str, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        if all(isinstance(v, torch.Tensor) and (v.dtype == dtype or not v.is_floating_point())
               for v in (*args, *kwargs.values())):
            return None  # inside a step the activations come in the compute dtype: no tree walk (~20 us a call)
        _warn_if_meant_in_fp32(name, args, kwargs, dtype, warned)
        return tree_map(cast, args), tree_map(cast, kwargs)

    for name, module in modules:
        module.register_forward_pre_hook(partial(hook, name), with_kwargs=True)


def _warn_if_meant_in_fp32(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
                           warned: set[str]) -> None:
    """Once per module: the step runs it in fp32 on purpose (its own ``torch.autocast(enabled=False)``, an fp32
    input), which setup would have kept in fp32 had it run the step (``PrecisionPolicy.keeping_fp32``)."""
    first = first_floating_tensor((*args, *kwargs.values()))
    if name in warned or first is None or first.dtype != torch.float32:
        return
    if not autocast_turned_off(first.device.type, AUTOCAST_FLOOR.level):
        return
    warned.add(name)
    rank_zero_warn(
        f"The step runs `{name}` inside its own `torch.autocast(..., enabled=False)` on fp32 inputs: DDP's AMP computes"
        f" it in fp32, here it computes in {dtype} (its input cast back), as setup ran no step to see it (no batch it"
        f" could read ahead). Keep it in fp32 by name: `Trainer(..., plugins=[VitScalePrecision(\"bf16-mixed\","
        f" full_precision={{\"{name}\"}})])`."
    )


def floating_buffers(module: nn.Module) -> tuple[list[str], list[str]]:
    """``module``'s own floating buffers, as (unsaved, saved). Unsaved (non-persistent) ones are constants a step
    meets (BEiT's zero key bias, Swin's window mask): they take the compute dtype at setup. Saved ones keep the master
    dtype: a checkpoint holds them, and one updated in place (a running centre) must not round to bf16."""
    unsaved = unsaved_buffer_names(module)
    names = [name for name, b in buffer_slots(module).items() if b is not None and b.is_floating_point()]
    return [n for n in names if n in unsaved], [n for n in names if n not in unsaved]


def autocast_around(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Run each module's forward under autocast in ``dtype``, its floating outputs back in its input's dtype: a saved
    fp32 buffer it owns then meets a bf16 matmul as under DDP's autocast (cast at its use), where O2 alone fails
    ("expected m1 and m2 to have the same dtype"). The exit runs when the forward raises too (``always_call``)."""
    entered: list[tuple[torch.autocast, torch.dtype | None]] = []  # nested forwards exit in reverse order

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        device = next(b.device for b in buffer_slots(module).values() if b is not None and b.is_floating_point())
        context = torch.autocast(device.type, dtype=dtype)
        context.__enter__()
        entered.append((context, first_floating_dtype(args, kwargs)))

    def leave(_: nn.Module, __: tuple[Any, ...], ___: dict[str, Any], output: Any) -> Any:
        context, out_dtype = entered.pop()
        context.__exit__(None, None, None)
        return output if out_dtype is None else tree_map(to_dtype(out_dtype), output)

    for module in modules:
        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)


def refuse_low_precision_statistics(module: nn.Module, keep: set[int], compute: torch.dtype,
                                     master: torch.dtype) -> None:
    """A batch norm left to compute in ``compute`` (``norm_dtype=None``, or not among ``norms``) would meet its
    running statistics, saved buffers kept in ``master``, with weights of another dtype, which torch's ``batch_norm``
    refuses at the first step ("expected scalar type BFloat16 but found Float"): said at setup. (Run on CPU: without
    weights it runs, and so does an instance norm with both, whose weights are expanded per sample first.)"""
    for name, m in module.named_modules():
        if id(m) not in keep and isinstance(m, BatchNormBase) and m.affine and m.track_running_stats:
            raise ValueError(
                f"{name} ({type(m).__name__}) would compute in {compute} with its running statistics kept in"
                f" {master}, which torch's batch_norm refuses. Keep normalization layers in fp32:"
                " VitScalePrecision(norm_dtype=torch.float32) (the default), with this layer among `norms`."
            )
