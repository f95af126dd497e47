"""A checkpoint's tensor-parallel row order: recorded by a sharded save, checked by every load.

A run under ``tensor_parallel`` holds packed projections (``[q; k; v]``) in per-rank row order, and so do its
sharded checkpoints' shards; the checkpoint says so under ``TENSOR_LAYOUT_KEY``, and a load under another layout is
refused before any tensor is read in the wrong order. Full files (DDP's, ``state_dict_type="full"``,
``consolidate``) hold the model's own layout, which any layout loads.
"""

from __future__ import annotations

from typing import Any

from lightning_vitscale._utils import TENSOR_LAYOUT_KEY
from lightning_vitscale.checkpoint.errors import TensorLayoutError
from lightning_vitscale.checkpoint.storage import Location


def record_tensor_layout(checkpoint: dict[str, Any], layout: dict[str, Any] | None, *, full: bool) -> None:
    """A sharded save of a run whose shards are in per-rank row order says so; a full one is in the model's own."""
    if layout is not None and not full:
        checkpoint[TENSOR_LAYOUT_KEY] = layout


def check_loaded_layout(loaded: dict[str, Any], location: Location, current: dict[str, Any] | None) -> None:
    """A file without the entry is in the model's own layout (DDP's, a full save, ``consolidate``): loaded so."""
    saved = loaded.get(TENSOR_LAYOUT_KEY)
    if saved is not None or not location.is_file():
        check_tensor_layout(saved, current)


def check_tensor_layout(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """Refuse a resume whose packed projections would be read in the wrong row order (a silent mix of heads)."""
    if saved == current:
        return

    def says(layout: dict[str, Any] | None) -> str:
        if layout is None:
            return "the model's own layout"
        return f"tensor_parallel={layout['tensor_parallel']} (packed rows per rank in {layout['interleaved'][:2]}...)"

    raise TensorLayoutError(
        f"This checkpoint holds {says(saved)} but this run has {says(current)}: its packed qkv rows would be read"
        " in another order. Resume it with the tensor_parallel it was saved with (checkpoints of packed"
        " projections do not move between tensor-parallel layouts yet)."
    )
