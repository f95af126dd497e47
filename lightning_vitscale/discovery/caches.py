"""Key-value caches passed to a block (Hugging Face ``transformers``' ``Cache`` objects: ``DynamicCache``,
``EncoderDecoderCache``): state a decoder layer appends to in its forward, in training too (``use_cache`` is on by
default). Run a second time on the same cache (a checkpoint's recompute, the planner's replay of a recorded block),
the layer appends again, to tensors of a graph already freed: torch's ``CheckpointError`` or "backward through the
graph a second time" (seen with ViT + GPT-2 captioning). HF passes no cache to a layer it checkpoints; neither do
the strategy's checkpointing nor the planner's replay."""

from __future__ import annotations

import sys
from typing import Any


def cache_class() -> type | None:
    """``transformers``' ``Cache`` base class where ``transformers`` is imported (an HF model's blocks were built by
    it), else ``None``: never imported here. A class, not a test by name: ``isinstance`` traces in a compiled block
    without a guard on state that changes (a memo dict filled at the first call recompiled every compiled block)."""
    module = sys.modules.get("transformers.cache_utils")
    found = getattr(module, "Cache", None) if module is not None else None
    return found if isinstance(found, type) else None


def is_key_value_cache(value: object) -> bool:
    kind = cache_class()
    return kind is not None and isinstance(value, kind)


def without_caches(args: tuple[Any, ...], kwargs: dict[str, Any], kind: type) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with each ``kind`` instance replaced by ``None``, the layers' own "no cache"."""
    if not any(isinstance(a, kind) for a in args) and not any(isinstance(v, kind) for v in kwargs.values()):
        return args, kwargs  # the common case, without copying
    return (tuple(None if isinstance(a, kind) else a for a in args),
            {k: None if isinstance(v, kind) else v for k, v in kwargs.items()})
