"""Activation checkpointing of blocks: ``"full"`` keeps each block's inputs and reruns its forward in backward;
``"selective"`` (torchtitan's op-SAC) also keeps the expensive ops' outputs (``memory.selective_contexts``) and
recomputes only the cheap ones: almost no extra FLOPs, the memory of the matmul outputs instead of everything.

A recompute reruns the forward's side effects too: a buffer it updates (BatchNorm's running statistics, a running
centre) would be updated twice a step, unlike under DDP, where nothing is checkpointed unless the user asks. What the
forward changed in a block's buffers is noted, and put back as the forward left it after the recompute (a compiled
block needs nothing: ``kernels/compile.py`` tells dynamo not to replay a forward's side effects).

A key-value cache a block fills in its forward (a Hugging Face decoder layer's) would be filled again by the
recompute (``discovery/caches.py``): a checkpointed block gets none, as under HF's own checkpointing, unless its class
says it only reads it (``_can_checkpoint_with_cache``). The loss is the same; a training step returns no cache."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_vitscale._compat import BatchNormBase, InstanceNormBase, buffer_slots, tensor_version
from lightning_vitscale.discovery.caches import cache_class, without_caches
from lightning_vitscale.memory import selective_contexts
from lightning_vitscale.sharding.checkpoint_frames import in_a_models_checkpoint

CheckpointMode = Literal["full", "selective"]
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = ("full", "selective")

_MARK = "_vitscale_checkpointed"


_PARENT_MARK = "_vitscale_checkpointed_by_parent"


def is_self_checkpointing(block: nn.Module) -> bool:
    """The model checkpoints ``block`` itself: HF `transformers` layers their own forward when
    ``gradient_checkpointing_enable()`` is on; timm models their blocks from the parent's forward when
    ``set_grad_checkpointing()`` is on (marked by :func:`mark_parent_checkpointing`)."""
    return getattr(block, _PARENT_MARK, False) or any(
        getattr(m, "gradient_checkpointing", False) is True for m in block.modules())


def mark_parent_checkpointing(model: nn.Module) -> None:
    """Mark every module below one whose ``grad_checkpointing`` is on (timm's ``set_grad_checkpointing()``: its
    forward runs each block under ``torch.utils.checkpoint``), so that no block there is checkpointed a second time
    (a nested checkpoint's hooks for nothing) and the summary and the planner describe the step that runs."""
    for parent in model.modules():
        if getattr(parent, "grad_checkpointing", False) is True:
            for module in parent.modules():
                if module is not parent:
                    setattr(module, _PARENT_MARK, True)


def _checkpointed_forward(original_forward, mode: CheckpointMode, owners: list[nn.Module], dropped: type | None,
                          *args: Any, **kwargs: Any) -> Any:
    if not torch.compiler.is_compiling() and in_a_models_checkpoint():  # once is enough (checkpoint_frames.py)
        return original_forward(*args, **kwargs)
    if dropped is not None and torch.is_grad_enabled():  # without gradients no recompute: the cache is filled once
        args, kwargs = without_caches(args, kwargs, dropped)
    # Non-reentrant: works with keyword arguments, inputs that do not require grad, and FSDP2's hooks
    # (the block's pre-backward hook gathers its parameters before autograd recomputes it).
    # preserve_rng_state (the default) replays the same dropout masks on recompute, in both modes.
    contexts: dict[str, Any] = {"context_fn": selective_contexts} if mode == "selective" else {}  # compiled: these two
    if owners and not torch.compiler.is_compiling():  # compiled: dynamo replays no side effect (compile.py)
        inner = contexts.get("context_fn", torch.utils.checkpoint.noop_context_fn)
        contexts = {"context_fn": functools.partial(_keeping_buffers, owners, inner)}
    return torch.utils.checkpoint.checkpoint(original_forward, *args, use_reentrant=False, **contexts, **kwargs)


# A buffer slot, its name, the tensor there before the forward, its version and values then, the tensor the forward
# left there, and whether to restore values whatever the versions say.
_Changed = list[tuple[dict[str, Any], str, torch.Tensor, int, torch.Tensor, torch.Tensor, bool]]
_STATISTICS = ("running_mean", "running_var")  # batch_norm updates them inside the kernel: no version bump


def _keeping_buffers(owners: list[nn.Module], inner: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``inner``'s forward and recompute contexts, the first noting which buffers of ``owners`` the forward updated
    or rebound, the second running the recompute from them as they were before the forward (spectral norm's weight
    depends on its power iteration's buffers) and putting them back as the forward left them."""
    forward_context, recompute_context = inner()
    changed: _Changed = []
    return _noting_changes(owners, forward_context, changed), _UndoingChanges(recompute_context, changed)


@contextmanager
def _noting_changes(owners: list[nn.Module], inner: Any, changed: _Changed) -> Iterator[None]:
    before = [(slots, name, tensor, tensor_version(tensor), tensor.detach().clone())
              for slots in map(buffer_slots, owners) for name, tensor in slots.items() if tensor is not None]
    with inner:
        yield
    statistics = {id(slots) for m in owners if isinstance(m, (BatchNormBase, InstanceNormBase)) and m.training
                  and m.track_running_stats for slots in [buffer_slots(m)]}
    for slots, name, tensor, version, value in before:
        always = id(slots) in statistics and name in _STATISTICS
        if always or slots[name] is not tensor or tensor_version(tensor) != version:
            changed.append((slots, name, tensor, version, value, slots[name], always))


class _UndoingChanges:  # entered once per recompute: a second backward (retain_graph) reruns it
    """Around a recompute: the changed buffers as the forward found them, then as it left them."""

    def __init__(self, inner: Any, changed: _Changed) -> None:
        self.inner, self.changed = inner, changed
        self.left: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor, bool, int]] = []

    def __enter__(self) -> None:
        self.left = [(slots, name, after, after.detach().clone(), always, 0)
                     for slots, name, _, _, _, after, always in self.changed]
        with torch.no_grad():
            for slots, name, before, version, value, _, always in self.changed:
                slots[name] = before
                if always or tensor_version(before) != version:  # updated in place: its values before the forward
                    before.copy_(value)
        self.left = [(*entry[:5], tensor_version(entry[2])) for entry in self.left]
        self.inner.__enter__()

    def __exit__(self, *raised: Any) -> Any:  # also when torch stops a recompute early (by raising)
        try:
            return self.inner.__exit__(*raised)
        finally:
            with torch.no_grad():
                for slots, name, after, value, always, version in self.left:
                    slots[name] = after  # a forward that rebinds (``self.center = ...``) made another in the recompute
                    if always or tensor_version(after) != version:
                        after.copy_(value)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: CheckpointMode = "full") -> None:
    """Checkpoint each module's forward in place: patching the instance's ``forward`` (not wrapping the module)
    keeps parameter names, and so checkpoint keys; applying again is a no-op (the first mode stays). A call inside a
    checkpoint the model makes itself runs the block as it is: its forward is not rerun twice in backward."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"Activation checkpointing mode must be one of {CHECKPOINT_MODES}; got {mode!r}.")
    for block in blocks:
        if getattr(block, _MARK, None):
            continue
        owners = [m for m in block.modules() if buffer_slots(m)]  # modules with buffers a recompute could update
        dropped = None if getattr(block, "_can_checkpoint_with_cache", False) else cache_class()  # caches.py
        block.forward = functools.partial(  # type: ignore[method-assign]
            _checkpointed_forward, block.forward, mode, owners, dropped)
        setattr(block, _MARK, mode)


def checkpoint_mode(block: nn.Module) -> CheckpointMode | None:
    """``"full"``, ``"selective"``, or ``None`` when the block is not checkpointed by this package."""
    return getattr(block, _MARK, None) or None
