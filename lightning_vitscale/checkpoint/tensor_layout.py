"""Which row order a checkpoint's packed projections are in, decided before any tensor is read.

Every checkpoint this package writes now holds the model's own layout: full files (DDP's, ``state_dict_type=
"full"``, ``consolidate``) and sharded folders alike (``own_layout.py`` writes a run's per-rank rows at their own
place), so any tensor-parallel layout loads it, turning the packed projections into its own per-rank order.

Sharded folders of earlier versions hold a run's packed projections in its per-rank row order and say so under
``TENSOR_LAYOUT_KEY``; those are read as they are under the layout they name, and refused under any other before
a tensor is read in the wrong order (``consolidate`` turns them into a file in the model's own layout).
"""

from __future__ import annotations

from typing import Any

from lightning_vitscale._utils import TENSOR_LAYOUT_KEY
from lightning_vitscale.checkpoint.errors import TensorLayoutError
from lightning_vitscale.checkpoint.own_layout import PackedRows


def rows_to_reorder(checkpoint: dict[str, Any], current: dict[str, Any] | None, packed: PackedRows) -> PackedRows:
    """The packed projections (of this run's ``packed``) that a load turns from the model's own row order into
    this run's per-rank order: all of them, unless ``checkpoint`` (its Lightning metadata) names the per-rank
    order an earlier version saved it in, which loads as it is under that layout only."""
    saved = checkpoint.get(TENSOR_LAYOUT_KEY)
    if saved is None:
        return packed
    check_tensor_layout(saved, current)
    return {}


def check_tensor_layout(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """Refuse a resume whose packed projections would be read in the wrong row order (a silent mix of heads)."""
    if saved == current:
        return

    def says(layout: dict[str, Any] | None) -> str:
        if layout is None:
            return "the model's own layout"
        return f"tensor_parallel={layout['tensor_parallel']} (packed rows per rank in {layout['interleaved'][:2]}...)"

    raise TensorLayoutError(
        f"This checkpoint, saved by an earlier lightning-vitscale, holds {says(saved)} but this run has"
        f" {says(current)}: its packed qkv rows would be read in another order. Resume it with the tensor_parallel"
        " it was saved with (its next save keeps the model's own layout, which loads under any layout), or turn it"
        " into one file in the model's own layout with `python -m lightning_vitscale consolidate SRC DST`."
    )
