"""FSDP1-era sharded checkpoints, written by torch's own FSDP1 (2 ranks, gloo), converted into one plain file:
the same tensors, bit for bit, as FSDP1's own FULL_STATE_DICT, and a plain model loads them strictly."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from lightning_vitscale import CheckpointError
from lightning_vitscale.__main__ import main
from lightning_vitscale.checkpoint.legacy_fsdp1 import load_fsdp1_state_dict
from lightning_vitscale.checkpoint.safe_reading import read_metadata
from lightning_vitscale.checkpoint.storage import Location
from tests.distributed.scripts.fsdp1_checkpoints import tiny_model
from tests.helpers.launch import assert_ok, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/distributed/scripts/fsdp1_checkpoints.py"
RECIPES = ("checkpointed", "compiled")


class Payload:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp1")
    assert_ok(torchrun(SCRIPT, str(out), timeout=180))
    return out


def test_fsdp1_wrote_real_per_rank_shards(saved):
    """The fixture really is sharded: every parameter's chunks come from both ranks' files."""
    for recipe in RECIPES:
        metadata = read_metadata(Location.of(saved / recipe / "sharded"), None)
        prefix = "model._orig_mod." if recipe == "compiled" else "model."  # torch.compile's wrapper stays in keys
        weight = metadata.state_dict_metadata[f"{prefix}0.weight"]
        assert len(weight.chunks) == 2 and weight.size == torch.Size([7, 5]), recipe
        files = {info.relative_path for info in metadata.storage_data.values()}
        assert files == {"__0_0.distcp", "__1_0.distcp"}, recipe


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_file_is_fsdp1s_full_state_dict_and_loads_strictly(saved, tmp_path, recipe):
    dst = tmp_path / f"{recipe}.ckpt"
    assert main(["consolidate", "--from", "fsdp1", str(saved / recipe / "sharded"), str(dst)]) == 0
    converted = torch.load(dst, weights_only=True)["state_dict"]
    oracle = {
        key.removeprefix("_orig_mod."): value
        for key, value in torch.load(saved / recipe / "full.pt", weights_only=True).items()
    }
    plain = tiny_model()
    assert list(converted) == list(oracle) == list(plain.state_dict())
    for key, value in oracle.items():
        assert converted[key].dtype == value.dtype and torch.equal(converted[key], value), key
    assert not torch.equal(plain.state_dict()["0.weight"], converted["0.weight"])  # training changed them
    assert str(plain.load_state_dict(converted, strict=True)) == "<All keys matched successfully>"


def test_crafted_metadata_is_refused_without_running_its_payload(saved, tmp_path):
    folder, marker = tmp_path / "crafted", tmp_path / "pwned"
    shutil.copytree(saved / "checkpointed" / "sharded", folder)
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="posix.system|weights_only=False"):
        load_fsdp1_state_dict(folder)
    assert not marker.exists()


def test_a_folder_without_dcp_metadata_or_model_entry_is_a_clear_error(saved, tmp_path, capsys):
    assert main(["consolidate", "--from", "fsdp1", str(saved / "checkpointed"), str(tmp_path / "x.ckpt")]) == 1
    assert "not an FSDP1 SHARDED_STATE_DICT folder (no .metadata)" in capsys.readouterr().err
    src = str(saved / "checkpointed" / "sharded")
    assert main(["consolidate", "--from", "fsdp1", "--weights", "ema", src, str(tmp_path / "y.ckpt")]) == 1
    assert "FSDP1 saved no EMA" in capsys.readouterr().err and not (tmp_path / "y.ckpt").exists()
    import torch.distributed.checkpoint as dcp

    dcp.save({"weights": {"w": torch.ones(2)}, "step": 3}, checkpoint_id=tmp_path / "other", no_dist=True)
    with pytest.raises(CheckpointError, match=r"holds no model state dict.*\['step', 'weights'\]"):
        load_fsdp1_state_dict(tmp_path / "other")
