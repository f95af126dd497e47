"""Checkpoint reading in one process: crafted pickles never run by default, fsspec URLs, DDP-style param groups."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_vitscale import CheckpointError, consolidate_checkpoint
from lightning_vitscale.__main__ import main
from lightning_vitscale.checkpoint.consolidate import consolidate_command
from lightning_vitscale.checkpoint.formats import checkpoint_shapes
from lightning_vitscale.checkpoint.optimizer_state import saved_param_groups
from lightning_vitscale.checkpoint.safe_reading import resolve_weights_only, safe_reader
from lightning_vitscale.checkpoint.save import model_state_dict, optimizer_state_dict, save_sharded
from lightning_vitscale.checkpoint.settings import CheckpointSettings
from lightning_vitscale.checkpoint.storage import Location
from tests.helpers.exploit import Payload


def tiny_state() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return model, {"state_dict": get_model_state_dict(model), "optimizer_states": [
        get_optimizer_state_dict(model, optimizer)]}


def lightning_metadata(**extra) -> dict:
    """What Lightning puts beside the tensors: loops, callbacks, schedulers, hyper-parameters (primitives)."""
    return {"epoch": 0, "global_step": 8, "pytorch-lightning_version": "2.6.6", "loops": {"fit_loop": {"n": 1}},
            "callbacks": {}, "lr_schedulers": [{"step_size": 3, "gamma": 0.5, "base_lrs": [0.1]}],
            "hyper_parameters": {"backbone": "encoder", "lr": 0.001, "betas": (0.9, 0.99)}, **extra}


def write_sharded(path: str | Path, **extra) -> nn.Module:
    model, checkpoint = tiny_state()
    checkpoint.update(lightning_metadata(**extra))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        save_sharded(checkpoint, Location.of(path))
    return model


def test_a_normal_sharded_checkpoint_consolidates_under_the_safe_default(tmp_path):
    model = write_sharded(tmp_path / "ok.ckpt")
    assert main(["consolidate", str(tmp_path / "ok.ckpt"), str(tmp_path / "ok-full.ckpt")]) == 0
    full = torch.load(tmp_path / "ok-full.ckpt", weights_only=True)
    assert full["hyper_parameters"]["betas"] == (0.9, 0.99) and full["optimizer_states"][0]["state"][0]["exp_avg"].shape
    for key, value in model.state_dict().items():
        assert torch.equal(full["state_dict"][key], value)


def test_crafted_full_file_is_refused_without_running_its_payload(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "hyper_parameters": {"x": Payload(marker)}}, path)
    with pytest.raises(CheckpointError, match="refuses .*posix.system.*weights_only=False"):
        checkpoint_shapes(path)
    assert not marker.exists()
    checkpoint_shapes(path, weights_only=False)  # the explicit opt-in for trusted files does run it
    assert marker.exists()


def test_crafted_dcp_metadata_is_refused_without_running_its_payload(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "crafted.ckpt"
    write_sharded(path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.planner_data["x"] = Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="refers to posix.system.*refusing"):
        checkpoint_shapes(path)
    assert main(["consolidate", str(path), str(tmp_path / "out.ckpt")]) == 1
    assert not marker.exists()


def test_consolidate_cli_refuses_crafted_metadata_and_values_unless_unsafe(tmp_path, capsys):
    marker = tmp_path / "pwned"
    write_sharded(tmp_path / "meta.ckpt", hyper_parameters={"x": Payload(marker)})
    assert main(["consolidate", str(tmp_path / "meta.ckpt"), str(tmp_path / "out.ckpt")]) == 1
    assert "weights_only" in capsys.readouterr().err and not marker.exists()

    model, checkpoint = tiny_state()  # a payload stored by DCP as a non-tensor value (a param-group entry)
    checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] = Payload(marker)
    checkpoint.update(lightning_metadata())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(checkpoint, Location.of(tmp_path / "value.ckpt"))
    assert main(["consolidate", str(tmp_path / "value.ckpt"), str(tmp_path / "out.ckpt")]) == 1
    assert "holds a value that loading with weights_only=True refuses" in capsys.readouterr().err
    assert not marker.exists()

    assert main(["consolidate", "--unsafe", str(tmp_path / "meta.ckpt"), str(tmp_path / "out.ckpt")]) == 0
    assert marker.exists()  # --unsafe is the trusted-legacy-file escape hatch, and it is really the old behaviour


def test_sharded_checkpoints_on_an_fsspec_url(tmp_path):
    """memory:// lives inside one process: a full round trip (save twice: atomic swap, shapes, consolidate)."""
    url = "memory://vitscale-test/run/last.ckpt"
    write_sharded(url)
    model = write_sharded(url)  # the second save swaps over the first one
    assert dict(checkpoint_shapes(url)) == {k: v.shape for k, v in model.state_dict().items()}
    assert not Location.of(url + ".partial").exists()
    consolidate_checkpoint(url, "memory://vitscale-test/run/model.ckpt")
    with Location.of("memory://vitscale-test/run/model.ckpt").open("rb") as f:
        full = torch.load(f, weights_only=True)
    assert all(torch.equal(full["state_dict"][k], v) for k, v in model.state_dict().items())
    with pytest.raises(FileNotFoundError, match="No checkpoint at memory://vitscale-test/run/nope.ckpt"):
        checkpoint_shapes("memory://vitscale-test/run/nope.ckpt")


def test_restore_takes_the_saved_param_groups_like_optimizer_load_state_dict(tmp_path):
    write_sharded(tmp_path / "c.ckpt")
    metadata = safe_reader(Location.of(tmp_path / "c.ckpt"), None).read_metadata()
    current = [{"lr": 0.5, "initial_lr": 0.5, "betas": (0.1, 0.2), "params": ["0.weight"]}]  # a scheduler added one
    groups = saved_param_groups(metadata, "optimizer_0", current)
    assert "initial_lr" not in groups[0] and {"lr", "betas", "eps", "weight_decay", "params"} <= groups[0].keys()
    state = {"optimizer_0": {"param_groups": groups}}
    dcp.load(state, checkpoint_id=tmp_path / "c.ckpt", no_dist=True)
    assert state["optimizer_0"]["param_groups"][0]["lr"] == 0.1  # the saved value, not the current one


def test_saving_before_the_first_step_leaves_the_optimizer_as_ddp_would(tmp_path):
    """torch's state-dict API would run a zero-gradient step on a fresh optimizer (Adam's step count -> 1)."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    checkpoint = {"state_dict": model_state_dict(model, full=False),
                  "optimizer_states": [optimizer_state_dict(model, optimizer, full=False, is_rank_zero=True)]}
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    checkpoint.update(lightning_metadata())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(checkpoint, Location.of(tmp_path / "fresh.ckpt"))
    consolidate_checkpoint(tmp_path / "fresh.ckpt", tmp_path / "fresh-full.ckpt")
    (saved,) = torch.load(tmp_path / "fresh-full.ckpt", weights_only=True)["optimizer_states"]
    assert saved["state"] == {} and saved["param_groups"][0]["params"] == [0, 1]  # what DDP writes before a step


def test_weights_only_default_follows_torch(monkeypatch):
    assert resolve_weights_only(None) is True and resolve_weights_only(False) is False
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert resolve_weights_only(None) is False


def test_state_dict_type_is_validated_and_the_hint_names_the_exact_command():
    assert CheckpointSettings("full").full and not CheckpointSettings().full
    with pytest.raises(ValueError, match="'sharded'.*'full'"):
        CheckpointSettings("fsdp")  # type: ignore[arg-type]
    assert consolidate_command("/runs/x/epoch=1.ckpt") == (
        "python -m lightning_vitscale consolidate /runs/x/epoch=1.ckpt /runs/x/epoch=1.consolidated.ckpt"
    )


def test_a_missing_truncated_or_garbled_shard_is_a_checkpoint_error_naming_the_file(tmp_path):
    """DCP raises a bare CheckpointException (a BaseException: ``except Exception`` misses it) naming no file."""
    for case in ("missing", "truncated", "garbled"):
        write_sharded(tmp_path / f"{case}.ckpt")
    shard = "__0_0.distcp"
    (tmp_path / "missing.ckpt" / shard).unlink()
    data = (tmp_path / "truncated.ckpt" / shard).read_bytes()
    (tmp_path / "truncated.ckpt" / shard).write_bytes(data[: len(data) // 2])
    (tmp_path / "garbled.ckpt" / shard).write_bytes(b"\0" * len(data))  # same length: only DCP's read fails
    for case, message, verify in (("missing", f"{shard} is missing", True),
                                  ("truncated", f"{shard} is truncated: it has", True),
                                  ("garbled", f"{shard} fails its CRC-32 check", True),
                                  ("garbled", "could not be read", False)):  # fmt: skip
        folder = tmp_path / f"{case}.ckpt"
        with pytest.raises(CheckpointError, match=message) as caught:
            consolidate_checkpoint(folder, tmp_path / "out.ckpt", verify=verify)
        assert str(folder) in str(caught.value)
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        checkpoint_shapes(tmp_path / "truncated.ckpt")  # what every strategy load checks before its collectives


def test_consolidate_names_what_src_and_dst_are_instead(tmp_path, capsys):
    write_sharded(tmp_path / "ok.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "single.ckpt")
    (tmp_path / "killed.ckpt.partial").mkdir()  # a save killed before any shard was written
    (tmp_path / "existing").mkdir()
    for args, message in (
        (["single.ckpt", "out.ckpt"], "is a single file, not a sharded checkpoint folder: it needs no consolidation"),
        (["killed.ckpt.partial", "out.ckpt"], "is an incomplete sharded checkpoint .* its save was interrupted"),
        (["killed.ckpt", "out.ckpt"], "No checkpoint at .*killed.ckpt. An interrupted save left"),
        (["ok.ckpt", "existing"], "existing is an existing folder; this command writes one file. Name it"),
    ):
        assert main(["consolidate", *(str(tmp_path / a) for a in args)]) == 1
        assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "out.ckpt").exists() and list((tmp_path / "existing").iterdir()) == []


def test_every_checkpoint_read_of_the_package_goes_through_the_safe_reader():
    """The one choke point: no module but safe_reading.py calls an unpickler or a DCP reader/loader itself."""
    import ast

    import lightning_vitscale

    readers = {"load", "load_state_dict", "dcp_load_into", "_load_state_dict", "FileSystemReader", "FsspecReader",
               "Unpickler", "load_file", "safe_open"}  # the last two: safetensors (export), read in load_safetensors
    modules = {"torch", "dcp", "pickle", "checkpoint", "state_dict_loader"}
    found = []
    root = Path(lightning_vitscale.__file__).parent
    for source in sorted(root.rglob("*.py")):
        if source.name == "safe_reading.py":
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                owner, name = func.value.id, func.attr  # torch.load(...), dcp.load(...)
            elif isinstance(func, ast.Name):
                owner, name = "", func.id  # dcp_load_into(...), FileSystemReader(...)
            else:
                continue  # self.scaler.load_state_dict(...) and the like: not a checkpoint read
            if name in readers and (owner in modules or not owner):
                found.append(f"{source.relative_to(root)}:{node.lineno} {owner}.{name}")
    assert not found, found
