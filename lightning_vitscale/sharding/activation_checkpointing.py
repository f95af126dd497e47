"""Activation checkpointing of blocks: keep each block's inputs, recompute its inside during backward."""

from __future__ import annotations

import functools
from typing import Any

import torch.utils.checkpoint
from torch import nn

_MARK = "_vitscale_checkpointed"


def is_self_checkpointing(block: nn.Module) -> bool:
    """HF `transformers` layers checkpoint their own forward when `gradient_checkpointing_enable()` is on."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in block.modules())


def _checkpointed_forward(original_forward, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant: works with keyword arguments, inputs that do not require grad, and FSDP2's hooks
    # (the block's pre-backward hook gathers its parameters before autograd recomputes it).
    # preserve_rng_state (the default) replays the same dropout masks on recompute.
    return torch.utils.checkpoint.checkpoint(original_forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Checkpoint each module's forward in place.

    Patching the instance's ``forward`` (rather than wrapping the module) keeps parameter names, and so
    checkpoint keys, unchanged; applying twice is a no-op.
    """
    for block in blocks:
        if getattr(block, _MARK, False):
            continue
        block.forward = functools.partial(_checkpointed_forward, block.forward)  # type: ignore[method-assign]
        setattr(block, _MARK, True)


def is_checkpointed(block: nn.Module) -> bool:
    return bool(getattr(block, _MARK, False))
