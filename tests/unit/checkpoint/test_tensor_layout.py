"""Which row order a checkpoint's packed projections are in: every checkpoint without the tensor-layout entry (all
that this version writes, DDP's files, consolidate) holds the model's own layout and loads under any layout; an
earlier version's sharded folder naming its per-rank order loads as it is under that layout and is refused under
any other, with a message that says how to move it.

Mutation seen failing: ``rows_to_reorder`` returning ``packed`` for a folder with the entry (it would be turned
into per-rank order a second time)."""

import pytest

from lightning_vitscale._utils import TENSOR_LAYOUT_KEY
from lightning_vitscale.checkpoint.errors import CheckpointError, TensorLayoutError
from lightning_vitscale.checkpoint.tensor_layout import rows_to_reorder
from lightning_vitscale.sharding import SetupSummary

TP2 = {"tensor_parallel": 2, "interleaved": ["blocks.0.attn.qkv"]}
PACKED = {"blocks.0.attn.qkv.weight": (3, 2), "blocks.0.attn.qkv.bias": (3, 2)}


def test_a_checkpoint_in_the_models_own_layout_is_reordered_into_any_runs_layout() -> None:
    assert rows_to_reorder({"state_dict": {}}, TP2, PACKED) == PACKED
    assert rows_to_reorder({}, None, {}) == {}  # tensor_parallel=1: nothing to reorder


def test_an_earlier_per_rank_save_loads_as_it_is_under_its_own_layout_only() -> None:
    assert rows_to_reorder({TENSOR_LAYOUT_KEY: TP2}, dict(TP2), PACKED) == {}
    own = "holds tensor_parallel=2.*this run has the model's own layout"
    with pytest.raises(TensorLayoutError, match=own) as caught:
        rows_to_reorder({TENSOR_LAYOUT_KEY: TP2}, None, {})
    assert isinstance(caught.value, CheckpointError)
    assert "consolidate" in str(caught.value) and "yet" not in str(caught.value)
    tp4 = {"tensor_parallel": 4, "interleaved": ["blocks.0.attn.qkv"]}
    with pytest.raises(TensorLayoutError, match="holds tensor_parallel=2.*this run has tensor_parallel=4"):
        rows_to_reorder({TENSOR_LAYOUT_KEY: TP2}, tp4, PACKED)


def test_the_setup_summary_says_what_an_earlier_folder_must_match() -> None:
    summary = SetupSummary(world_size=2, blocks={}, block_names=[], units=1, checkpointed=[])
    assert summary.tensor_layout is None
    summary.tensor_parallel, summary.tensor_interleaved = 2, ["blocks.0.attn.qkv"]
    assert summary.tensor_layout == TP2
