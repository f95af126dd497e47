"""FSDP1-era sharded checkpoints, written by torch's own FSDP1 (2 ranks, gloo), converted into one plain file:
the same tensors, bit for bit, as FSDP1's own FULL_STATE_DICT, and a plain model loads them strictly. Both
SHARDED_STATE_DICT folders and LOCAL_STATE_DICT rank files (their flat parameters split by the model's layout)."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from lightning_vitscale import CheckpointError
from lightning_vitscale.__main__ import main
from lightning_vitscale.checkpoint.fsdp1.local import load_fsdp1_local_state_dict
from lightning_vitscale.checkpoint.fsdp1.sharded import load_fsdp1_state_dict
from lightning_vitscale.checkpoint.fsdp1.sharded_tensor_pickle import as_local_shards, load_local_shards
from lightning_vitscale.checkpoint.safe_reading import read_metadata
from lightning_vitscale.checkpoint.storage import Location
from tests.distributed.scripts.fsdp1_checkpoints import LOCAL_RECIPES, TinyViT, local_model, tiny_model
from tests.helpers.exploit import Payload
from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/distributed/scripts/fsdp1_checkpoints.py"
RECIPES = ("checkpointed", "compiled")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return launch_ranks(tmp_path_factory, "fsdp1", SCRIPT, pattern=None, timeout=180)[0]


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


LOCAL = "tests.distributed.scripts.fsdp1_checkpoints:local_model"


def local_files(saved, recipe: str) -> str:
    return str(saved / "local" / recipe / "model_0000002.rank_*.pth")


@pytest.mark.parametrize("recipe", list(LOCAL_RECIPES))
def test_local_state_dict_rank_files_become_fsdp1s_full_state_dict(saved, tmp_path, recipe):
    """FSDP1's LOCAL_STATE_DICT (nested block units; use_orig_params False, True, True under bf16 mixed
    precision), split with the layout rebuilt from the model: FSDP1's own FULL_STATE_DICT, bit for bit."""
    dst = tmp_path / f"{recipe}.ckpt"
    assert main(["consolidate", "--from", "fsdp1-local", "--model", LOCAL, local_files(saved, recipe), str(dst)]) == 0
    converted = torch.load(dst, weights_only=True)["state_dict"]
    oracle = torch.load(saved / "local" / recipe / "full.pt", weights_only=True)
    plain = local_model()
    assert list(converted) == list(oracle) == list(plain.state_dict())
    for key, value in oracle.items():
        assert converted[key].dtype == value.dtype and torch.equal(converted[key], value), key
    assert not torch.equal(plain.state_dict()["blocks.1.fc2.weight"], converted["blocks.1.fc2.weight"])
    assert str(plain.load_state_dict(converted, strict=True)) == "<All keys matched successfully>"
    assert plain.head.weight is plain.embed.weight  # the tied parameter: one tensor under both names


def test_local_files_hold_padded_flat_shards_of_each_unit(saved):
    """The fixtures exercise what the layout must get right: every unit's flat parameter split over both ranks,
    alignment padding inside it with use_orig_params (in fp32 elements, or bf16 ones under mixed precision)."""
    plain = sum(p.numel() for p in local_model().blocks[0].parameters())
    sizes = {}
    for recipe in LOCAL_RECIPES:
        files = sorted((saved / "local" / recipe).glob("*.pth"))
        ranks = [load_local_shards(Location.of(file), None)["model"] for file in files]
        flat = [as_local_shards(rank["blocks.0._flat_param"], "blocks.0") for rank in ranks]
        assert [shard.rank for shard in flat] == [0, 1] and all(shard.pieces for shard in flat), recipe
        sizes[recipe] = flat[0].numel
        assert {"_flat_param", "blocks.1._flat_param"} <= set(ranks[0])
    assert sizes["flat"] == plain < sizes["orig"] < sizes["bf16"]


def test_a_model_that_differs_names_the_unit_and_the_difference(saved, tmp_path, capsys):
    files = local_files(saved, "orig")
    with pytest.raises(CheckpointError, match=r"unit 'blocks.0'.* hold 180 elements .* flat parameter 190: \+10"):
        load_fsdp1_local_state_dict(files, TinyViT(), aligned_numel=0)  # use_orig_params=False's layout: no padding
    with pytest.raises(CheckpointError, match=r"unit 'blocks.0'.* hold 252 elements .* flat parameter 190: -62"):
        load_fsdp1_local_state_dict(files, TinyViT(dim=6))
    with pytest.raises(CheckpointError, match=r"unit '<root>'.*flat parameter 58"):
        load_fsdp1_local_state_dict(files, TinyViT(depth=3))  # blocks.2 was no unit: its parameters land in the root
    with pytest.raises(CheckpointError, match=r"flat parameters of FSDP1 units \['blocks.0', 'blocks.1'\]"):
        load_fsdp1_local_state_dict(files, tiny_model())
    with pytest.raises(CheckpointError, match="does not match the model.*missing \\(1\\): extra"):
        model = TinyViT()
        model.register_buffer("extra", torch.zeros(1))
        load_fsdp1_local_state_dict(files, model)


def test_local_rank_files_missing_or_unreadable_are_clear_errors(saved, tmp_path, capsys):
    one = str(saved / "local" / "flat" / "model_0000002.rank_1.pth")
    src = str(saved / "local" / "flat")
    argv = ["consolidate", "--from", "fsdp1-local", "--model", LOCAL]
    assert main([*argv, one, str(tmp_path / "a.ckpt")]) == 1
    assert "hold ranks [1] of a world of [2]" in capsys.readouterr().err
    assert main([*argv, src, str(tmp_path / "b.ckpt")]) == 1  # the folder also holds full.pt
    assert "full.pt holds no FSDP1 flat parameter" in capsys.readouterr().err
    assert main(["consolidate", "--from", "fsdp1-local", local_files(saved, "flat"), str(tmp_path / "c.ckpt")]) == 1
    assert "needs --model package.module:callable" in capsys.readouterr().err
    assert main([*argv[:-1], "no_such_module:build", local_files(saved, "flat"), str(tmp_path / "d.ckpt")]) == 1
    assert "cannot import it" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
