"""The safe reading of FSDP1 LOCAL_STATE_DICT rank files in one process: only the ShardedTensor family becomes
inert records; any other global, a getattr beyond ShardedTensor.ProcessGroupState, or a tensor subclass other
than ShardedTensor is refused before it is built. (Real FSDP1 files: tests/distributed/test_fsdp1_checkpoints.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_vitscale import CheckpointError
from lightning_vitscale.checkpoint.fsdp1.local import load_fsdp1_local_state_dict
from lightning_vitscale.checkpoint.fsdp1.sharded_tensor_pickle import load_local_shards
from lightning_vitscale.checkpoint.storage import Location
from tests.helpers.exploit import Payload


class Reduces:
    """Pickles as ``func(*args)``: what a crafted file can ask the unpickler to call."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def crafted(tmp_path: Path, value) -> Path:
    path = tmp_path / "model.rank_0.pth"
    torch.save({"model": {"_flat_param": value, "scale": torch.ones(2)}, "iteration": 1}, path)
    return path


def test_a_crafted_rank_file_is_refused_without_running_its_payload(tmp_path):
    marker = tmp_path / "pwned"
    path = crafted(tmp_path, Payload(marker))
    with pytest.raises(CheckpointError, match=r"global posix\.system.*refusing.*--unsafe"):
        load_local_shards(Location.of(path), None)
    with pytest.raises(CheckpointError, match=r"global posix\.system"):
        load_fsdp1_local_state_dict(path, nn.Linear(2, 2))
    assert not marker.exists()
    load_local_shards(Location.of(path), weights_only=False)  # the explicit opt-in for trusted files does run it
    assert marker.exists()


def test_getattr_is_answered_only_for_the_process_group_state(tmp_path):
    path = crafted(tmp_path, Reduces(getattr, torch.Tensor, "__init__"))
    with pytest.raises(CheckpointError, match=r"getattr\(<class 'torch.Tensor'>, '__init__'\); refusing"):
        load_local_shards(Location.of(path), None)


def test_only_sharded_tensor_is_rebuilt_as_a_tensor_subclass(tmp_path):
    from torch._tensor import _rebuild_from_type_v2
    from torch._utils import _rebuild_wrapper_subclass

    path = crafted(tmp_path, Reduces(_rebuild_from_type_v2, _rebuild_wrapper_subclass, torch.Tensor, (), ()))
    with pytest.raises(CheckpointError, match="tensor subclass other than ShardedTensor; refusing"):
        load_local_shards(Location.of(path), None)


def test_a_file_without_flat_parameters_is_not_a_rank_file(tmp_path):
    torch.save({"model": {"weight": torch.ones(2)}}, tmp_path / "full.pt")
    with pytest.raises(CheckpointError, match=r"holds no FSDP1 flat parameter.*\['model'\]"):
        load_fsdp1_local_state_dict(tmp_path, nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="no files match"):
        load_fsdp1_local_state_dict(tmp_path / "*.rank_*.pth", nn.Linear(2, 2))
