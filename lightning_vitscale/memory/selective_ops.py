"""Which ops selective activation checkpointing stores (the expensive ones), and the context pair that does it: here,
below the sharding setup, because the planner measures a selective block with the same policy."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
_SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
SAVED_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name).default for name in _SAVED_OP_NAMES if hasattr(_aten, name)
)
"""Ops that cost FLOPs (``linear`` reaches the dispatcher as ``mm``/``addmm``, SDPA as a fused kernel or ``bmm``)."""


def _save_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # MUST_SAVE, not PREFER_SAVE: torch.compile's partitioner may otherwise recompute a matmul to save memory.
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_save_expensive_ops)


