"""Which ops selective activation checkpointing stores (the expensive ones) and the context pair that makes
``torch.utils.checkpoint`` do it. Here, below the sharding setup that applies it, because the planner measures a
selective block on fake tensors with the same policy (``activations.py``)."""

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
"""Ops whose outputs selective checkpointing stores: the ones that cost FLOPs (``aten.linear`` reaches the
dispatcher as ``mm``/``addmm``; ``F.scaled_dot_product_attention`` as one of the fused kernels, or ``bmm`` on
its math path). Everything else is recomputed."""


def _save_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # MUST_SAVE, not PREFER_SAVE: torch.compile's partitioner may otherwise recompute a matmul to save memory.
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """The (forward, recompute) context pair that makes ``torch.utils.checkpoint`` save :data:`SAVED_OPS`."""
    return create_selective_checkpoint_contexts(_save_expensive_ops)


