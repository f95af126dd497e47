"""A checkpoint's tensor-parallel row order: a sharded save records it, a load under another order is refused,
and files in the model's own layout (DDP's, full saves, ``consolidate``) load under any layout."""

from pathlib import Path

import pytest

from lightning_vitscale.checkpoint.errors import CheckpointError, TensorLayoutError
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.checkpoint.tensor_layout import check_loaded_layout, record_tensor_layout
from lightning_vitscale.sharding import TENSOR_LAYOUT_KEY, SetupSummary

TP2 = {"tensor_parallel": 2, "interleaved": ["blocks.0.attn.qkv"]}


def test_sharded_save_records_the_row_order_and_a_full_one_does_not() -> None:
    sharded: dict = {}
    record_tensor_layout(sharded, TP2, full=False)
    assert sharded[TENSOR_LAYOUT_KEY] == TP2
    full: dict = {}
    record_tensor_layout(full, TP2, full=True)  # a full file holds the model's own rows
    assert TENSOR_LAYOUT_KEY not in full
    plain: dict = {}
    record_tensor_layout(plain, None, full=False)
    assert TENSOR_LAYOUT_KEY not in plain


def test_load_refuses_another_row_order(tmp_path: Path) -> None:
    folder = Location.of(str(tmp_path))  # a sharded folder
    with pytest.raises(TensorLayoutError, match="tensor_parallel=2.*the model's own layout") as caught:
        check_loaded_layout({TENSOR_LAYOUT_KEY: TP2}, folder, None)
    assert isinstance(caught.value, CheckpointError)
    with pytest.raises(TensorLayoutError, match="the model's own layout.*tensor_parallel=2"):
        check_loaded_layout({}, folder, TP2)  # a folder saved without tensor parallelism
    check_loaded_layout({TENSOR_LAYOUT_KEY: TP2}, folder, dict(TP2))


def test_a_file_without_the_entry_loads_under_any_layout(tmp_path: Path) -> None:
    file = tmp_path / "ddp.ckpt"
    file.write_bytes(b"")
    check_loaded_layout({}, Location.of(str(file)), TP2)


def test_the_setup_summary_says_what_saves_record() -> None:
    summary = SetupSummary(world_size=2, blocks={}, block_names=[], units=1, checkpointed=[])
    assert summary.tensor_layout is None
    summary.tensor_parallel, summary.tensor_interleaved = 2, ["blocks.0.attn.qkv"]
    assert summary.tensor_layout == TP2
