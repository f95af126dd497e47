"""Key-value caches passed to a block (Hugging Face ``transformers``' ``Cache`` objects: ``DynamicCache``,
``EncoderDecoderCache``): state a decoder layer appends to in its forward, in training too (``use_cache`` is on by
default). Run a second time on the same cache (a checkpoint's recompute, the planner's replay of a recorded block),
the layer appends again, to tensors of a graph already freed: torch's ``CheckpointError`` or "backward through the
graph a second time" (seen with ViT + GPT-2 captioning). HF passes no cache to a layer it checkpoints; neither do
the strategy's checkpointing nor the planner's replay."""

from __future__ import annotations

from typing import Any


def is_key_value_cache(value: object) -> bool:
    """A ``transformers`` cache, recognised without importing ``transformers``."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def without_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with each cache replaced by ``None``, the layers' own "no cache"."""
    return (tuple(None if is_key_value_cache(a) else a for a in args),
            {k: None if is_key_value_cache(v) else v for k, v in kwargs.items()})
