"""Activation checkpointing of blocks: ``"full"`` keeps each block's inputs and reruns its forward in backward;
``"selective"`` (torchtitan's op-SAC) also keeps the expensive ops' outputs (``memory.selective_contexts``) and
recomputes only the cheap ones: almost no extra FLOPs, the memory of the matmul outputs instead of everything."""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_vitscale.memory import selective_contexts

CheckpointMode = Literal["full", "selective"]
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = ("full", "selective")

_MARK = "_vitscale_checkpointed"


def is_self_checkpointing(block: nn.Module) -> bool:
    """HF `transformers` layers checkpoint their own forward when `gradient_checkpointing_enable()` is on."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in block.modules())


def _checkpointed_forward(original_forward, mode: CheckpointMode, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant: works with keyword arguments, inputs that do not require grad, and FSDP2's hooks
    # (the block's pre-backward hook gathers its parameters before autograd recomputes it).
    # preserve_rng_state (the default) replays the same dropout masks on recompute, in both modes.
    if mode == "selective":
        return torch.utils.checkpoint.checkpoint(
            original_forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs
        )
    return torch.utils.checkpoint.checkpoint(original_forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: CheckpointMode = "full") -> None:
    """Checkpoint each module's forward in place: patching the instance's ``forward`` (not wrapping the module)
    keeps parameter names, and so checkpoint keys; applying again is a no-op (the first mode stays)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"Activation checkpointing mode must be one of {CHECKPOINT_MODES}; got {mode!r}.")
    for block in blocks:
        if getattr(block, _MARK, None):
            continue
        block.forward = functools.partial(_checkpointed_forward, block.forward, mode)  # type: ignore[method-assign]
        setattr(block, _MARK, mode)


def checkpoint_mode(block: nn.Module) -> CheckpointMode | None:
    """``"full"``, ``"selective"``, or ``None`` when the block is not checkpointed by this package."""
    return getattr(block, _MARK, None) or None
