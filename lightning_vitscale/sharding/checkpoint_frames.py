"""Whether a block's call runs inside a ``torch.utils.checkpoint`` the model made itself: read from the callers'
frames, since nothing on the tensors or in torch's state says it.

Two uses. A reentrant checkpoint runs its function without gradients, then again in backward, so its first run looks
like an evaluation's to the skipped-block check (``skipped_blocks.py``). And a block the model already checkpoints
(``x = checkpoint(block, x)`` in its forward: Swin's reference code, many research repositories, beside timm's and
HF's flags that setup reads) is not checkpointed a second time by the recipe (``activation_checkpointing.py``):
nested, each block ran its forward three times a step instead of two, for no memory saved (the outer checkpoint
already keeps only its inputs).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointFunction

from lightning_vitscale._compat import current_backward_id

_CHECKPOINT_CALL = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__  # either kind, and checkpoint_sequential
_REENTRANT_FORWARD = CheckpointFunction.forward.__code__
FRAMES = 32  # a checkpoint around a whole backbone sits ~10 frames above its blocks' forwards


def _caller_running(code: object, frames: int) -> dict[str, Any] | None:
    """The locals of the nearest caller (within ``frames``, this function's caller excluded) running ``code``."""
    frame = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    for _ in range(frames):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals
        frame = frame.f_back
    return None


def in_a_reentrant_checkpoint(frames: int = FRAMES) -> bool:
    """Whether a reentrant checkpoint's forward is among the callers and one of its inputs requires a gradient: it
    runs its function with gradients off (every block of a ``checkpoint_sequential`` segment), then again in
    backward. Nothing else tells its call from an evaluation's. Asked only where gradients are off."""
    found = _caller_running(_REENTRANT_FORWARD, frames)
    inputs = found.get("args", ()) if found is not None else ()
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in inputs)


def in_a_models_checkpoint(frames: int = FRAMES) -> bool:
    """Whether this call runs inside a checkpoint the model made: in its forward, a call of
    ``torch.utils.checkpoint.checkpoint`` among the callers; in backward, any call (a checkpoint's recompute,
    reentrant or not: the recipe's own recomputes run the block's original forward, which never asks)."""
    return current_backward_id() != -1 or _caller_running(_CHECKPOINT_CALL, frames) is not None
