"""A step's term on sharded parameters meeting the plain loss (an L2 term over ``self.parameters()``, a distance to
saved plain weights: L2-SP, an orthogonality penalty on a block's weight) computed as DDP computes it.

Under DDP every parameter is a plain tensor. Here a block unit's parameter is a DTensor (its shard) outside its
unit's forward, so such a term mixes a DTensor with plain tensors: torch raises "got mixed torch.Tensor and DTensor"
for a plain tensor of more than one element, and lets a plain one-element tensor in (the loss plus a penalty) only
to hand the DTensor's gradient to the plain graph in backward, where it raises the same.

So while a training step runs, on the step's thread, an operation mixing the two where torch would raise (a plain
operand of more than one element, or one in the autograd graph; a plain one-element constant is taken as
replicated by DTensor itself, as before) takes each DTensor operand as the whole tensor it stands for
(``full_tensor()``: an all-reduce for a sum over shards, an all-gather for a parameter). The gradient reaching that
whole tensor is what this rank's loss makes of it; DDP averages every gradient over the ranks, so it is averaged
over the ranks before it reaches the shards (taken as ``Partial`` over the mesh, divided by its size). A DTensor
made only from parameters has the same value on every rank, so the shards get DDP's averaged gradient, through the
sharded parameter's own gradient, to which FSDP2 adds the reduced one. Under bf16 O2 a whole tensor holds the fp32
master's values; where the operation then meets bf16 data it runs under autocast, as every operation of DDP's AMP
step does (``precision/library_ops.py``).

Left to torch (named by ``mixed_tensors.py``): an in-place write of a plain tensor into a DTensor (a shard cannot
hold a whole tensor), and everything inside torch's ``implicit_replication()``. Every rank must reach the same mixed
operations in the same order, as every rank reaches the forward's collectives: each is a collective.

The dispatch is DTensor's ``__torch_function__``, swapped in for the step only: FSDP2's forward runs on gathered
plain tensors, so only the user's arithmetic on shards passes through it (no per-operation cost on the forward).
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from lightning_vitscale._compat import DISABLED_TORCH_FUNCTION, dtensor_takes_plain_as_replicated, tree_leaves, tree_map
from lightning_vitscale.precision.library_ops import autocast_as_amp_would

_STEP = threading.local()  # .depth: steps entered on this thread (a step inside a step: gradients of gradients)
_LOCK = threading.Lock()


class _MeanOverRanks(torch.autograd.Function):
    """Identity whose backward divides by the number of ranks: with the gradient taken as ``Partial`` (summed over
    the ranks) on its way to the shards, the mean over the ranks, as DDP's."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.ranks, None


def whole(tensor: Any) -> Any:
    """A DTensor as the plain whole tensor it stands for, its gradient DDP's: averaged over the ranks; anything
    else as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh = tensor.device_mesh
    made = tensor.full_tensor(grad_placements=[Partial()] * mesh.ndim)
    if not made.requires_grad or mesh.size() == 1:
        return made
    return _MeanOverRanks.apply(made, mesh.size())


_WRITING_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__",
                              "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                              "__ilshift__", "__irshift__"})


def _writes_a_dtensor(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An in-place or ``out=`` operation whose destination holds a DTensor."""
    out = kwargs.get("out")
    if out is not None:
        return any(isinstance(t, DTensor) for t in tree_leaves(out))
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.startswith("__")) or name in _WRITING_DUNDERS
    return in_place and bool(args) and any(isinstance(t, DTensor) for t in tree_leaves(args[0]))


def _differentiates(func: Any) -> bool:
    """``torch.autograd.grad`` / ``backward`` (their arguments pass through here too): the tensors named are the
    graph's own, never to be replaced by whole copies (``gradients_of_gradients.py`` maps shards to the graph's)."""
    return func is torch.Tensor.backward or getattr(func, "__module__", "").startswith("torch.autograd")


def _mixed_as_torch_refuses(tensors: list[Any]) -> bool:
    """A DTensor among plain tensors that torch refuses to mix: one of more than one element, or one in the
    autograd graph (DTensor lets a plain one-element tensor in as replicated, and its backward then fails)."""
    if not any(isinstance(t, DTensor) for t in tensors):
        return False
    return any(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and (t.numel() > 1 or t.requires_grad)
               for t in tensors)


def _torch_function(cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
    if len(args) < 2 and not kwargs and not (args and isinstance(args[0], (list, tuple))):
        return DISABLED_TORCH_FUNCTION(func, types, args, {})  # one tensor (an attribute read): nothing mixed
    kwargs = kwargs or {}
    if (getattr(_STEP, "depth", 0) and not _differentiates(func)
            and _mixed_as_torch_refuses(tree_leaves((args, kwargs))) and not _writes_a_dtensor(func, args, kwargs)
            and not dtensor_takes_plain_as_replicated()):
        args, kwargs = tree_map(whole, (args, kwargs))
        with autocast_as_amp_would(tree_leaves((args, kwargs))):  # bf16 data meeting an fp32 master's values
            return func(*args, **kwargs)
    return DISABLED_TORCH_FUNCTION(func, types, args, kwargs)


_OURS: Any = classmethod(_torch_function)


class _Dispatch:
    """DTensor's ``__torch_function__`` is ours while a step runs outside the blocks' forwards (``steps``: steps in
    progress, on any thread; ``paused``: block forwards entered). A block's forward gathers its unit (FSDP2 reads
    each shard's ``requires_grad``, ``dtype``, ``device``: ~5 reads a parameter a step, ~1 us each through a Python
    ``__torch_function__``, ~2 ms a ViT-H step) and computes on plain tensors: nothing there for this module."""

    steps = 0
    paused = 0

    @classmethod
    def apply(cls) -> None:
        ours = cls.steps > 0 and cls.paused == 0
        DTensor.__torch_function__ = _OURS if ours else DISABLED_TORCH_FUNCTION  # type: ignore[assignment]

    @classmethod
    def pause(cls, *_: Any) -> None:
        if cls.steps:
            cls.paused += 1
            cls.apply()

    @classmethod
    def resume(cls, *_: Any) -> None:
        if cls.steps and cls.paused:
            cls.paused -= 1
            cls.apply()


@contextmanager
def whole_where_mixed() -> Generator[None, None, None]:
    """Within the block, on this thread, operations mixing DTensors and plain tensors take the DTensors whole (see
    the module docstring); not inside the blocks' forwards (:func:`pause_in_forwards`)."""
    with _LOCK:
        _Dispatch.steps += 1
        _Dispatch.apply()
    _STEP.depth = getattr(_STEP, "depth", 0) + 1
    try:
        yield
    finally:
        _STEP.depth -= 1
        with _LOCK:
            _Dispatch.steps -= 1
            if _Dispatch.steps == 0:
                _Dispatch.paused = 0  # a forward that raised never resumed
            _Dispatch.apply()


@contextmanager
def paused() -> Generator[None, None, None]:
    """DTensor's own dispatch within the block (a unit gathered outside any block's forward: prefetch on entry)."""
    _Dispatch.pause()
    try:
        yield
    finally:
        _Dispatch.resume()


def pause_in_forwards(blocks: list[nn.Module]) -> None:
    """Each of ``blocks`` (sharded already) runs its forward, FSDP2's gather and reshard around it included, with
    DTensor's own dispatch: hooks before FSDP2's pre-forward hook (registered first, it is prepended) and after its
    post-forward hook."""
    for block in blocks:
        block.register_forward_pre_hook(_Dispatch.pause, prepend=True)
        block.register_forward_hook(_Dispatch.resume)
