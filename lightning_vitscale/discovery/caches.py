"""Key-value caches passed to a block (Hugging Face ``transformers``' ``Cache`` objects: ``DynamicCache``,
``EncoderDecoderCache``): state a decoder layer appends to in its forward, in training too (``use_cache`` is on by
default). Run a second time on the same cache (a checkpoint's recompute, the planner's replay of a recorded block),
the layer appends again, to tensors of a graph already freed: torch's ``CheckpointError`` or "backward through the
graph a second time" (seen with ViT + GPT-2 captioning). HF passes no cache to a layer it checkpoints; neither do
the strategy's checkpointing nor the planner's replay."""

from __future__ import annotations

from typing import Any

# By type: every checkpointed block's call asks for each of its arguments (host time per step: ~0.7 us a call).
_CACHE_TYPES: dict[type, bool] = {}


def is_key_value_cache(value: object) -> bool:
    """A ``transformers`` cache, recognised without importing ``transformers``."""
    kind = type(value)
    found = _CACHE_TYPES.get(kind)
    if found is None:
        found = _CACHE_TYPES[kind] = any(
            c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in kind.__mro__)
    return found


def without_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with each cache replaced by ``None``, the layers' own "no cache"."""
    if not any(map(is_key_value_cache, args)) and not any(map(is_key_value_cache, kwargs.values())):
        return args, kwargs  # the common case, without copying
    return (tuple(None if is_key_value_cache(a) else a for a in args),
            {k: None if is_key_value_cache(v) else v for k, v in kwargs.items()})
