"""A sharded folder where Lightning reads DDP's file, through the public routes: ``load_from_checkpoint(consolidated(
folder))`` and a single-device resume with ``VitScaleCheckpointIO`` give what the same run's full (DDP-format) file
and its consolidated file give; crafted pickles never run; folders that are not ours fail as Lightning fails, and so
does a plain ``load_from_checkpoint(folder)`` (nothing of Lightning is patched)."""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_vitscale import (
    CheckpointError,
    VitScaleCheckpointIO,
    VitScaleStrategy,
    consolidate_checkpoint,
    consolidated,
)
from lightning_vitscale.checkpoint.lightning.loaders import is_sharded_checkpoint
from tests.helpers.exploit import Payload
from tests.helpers.models import Classifier, loader
from tests.helpers.saved_runs import restamp

FIXED = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(7))
URL = "memory://vitscale-loader/sharded.ckpt"


def make_trainer(strategy, steps: int, plugins=None) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, enable_checkpointing=False, plugins=plugins)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, mesh) -> Path:
    """One 4-step fit under VitScaleStrategy, saved as a sharded folder (local, file://, memory://), as a full
    file (DDP's format), weights-only, and consolidated."""
    out = tmp_path_factory.mktemp("loader")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.seed_everything(0, verbose=False)
        trainer = make_trainer(VitScaleStrategy(), 4)
        trainer.fit(Classifier("encoder"), loader(n=32))
        for path in (out / "sharded.ckpt", f"file://{out}/url.ckpt", URL):
            trainer.save_checkpoint(path)
        trainer.save_checkpoint(out / "weights-only.ckpt", weights_only=True)
        trainer.strategy.state_dict_type = "full"
        trainer.save_checkpoint(out / "full.ckpt")
    consolidate_checkpoint(out / "sharded.ckpt", out / "consolidated.ckpt")
    return out


def assert_same_model(a: L.LightningModule, b: L.LightningModule) -> None:
    assert a.hparams == b.hparams and a.state_dict().keys() == b.state_dict().keys()
    for key, value in b.state_dict().items():
        assert torch.equal(a.state_dict()[key], value), key
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(a(FIXED), b(FIXED))


def test_load_from_checkpoint_reads_a_sharded_folder_like_the_full_and_consolidated_files(saved):
    full = Classifier.load_from_checkpoint(saved / "full.ckpt")
    assert_same_model(Classifier.load_from_checkpoint(saved / "consolidated.ckpt"), full)
    for path in (saved / "sharded.ckpt", str(saved / "sharded.ckpt"), f"file://{saved}/url.ckpt", URL):
        model = Classifier.load_from_checkpoint(consolidated(path), map_location="cpu", strict=True, weights_only=True)
        assert_same_model(model, full)
    overridden = Classifier.load_from_checkpoint(consolidated(saved / "sharded.ckpt"), lr=0.5)
    assert overridden.hparams.lr == 0.5 and overridden.hparams.backbone == "encoder"


def test_the_folder_reads_as_the_dict_torch_load_gives_for_the_full_file(saved):
    ours = VitScaleCheckpointIO().load_checkpoint(saved / "sharded.ckpt")
    full = torch.load(saved / "full.ckpt", weights_only=True)
    assert ours.keys() == full.keys()
    for key, value in full["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    (ours_opt,), (full_opt,) = ours["optimizer_states"], full["optimizer_states"]
    assert ours_opt["param_groups"] == full_opt["param_groups"] and ours_opt["state"].keys() == full_opt["state"].keys()
    for index, state in full_opt["state"].items():
        assert all(torch.equal(ours_opt["state"][index][name], value) for name, value in state.items())
    for key in ("loops", "lr_schedulers", "callbacks", "epoch", "global_step", "hyper_parameters"):
        assert ours[key] == full[key], key


def test_map_location_follows_torch_load(saved):
    meta = VitScaleCheckpointIO().load_checkpoint(saved / "sharded.ckpt", map_location="meta")
    reference = torch.load(saved / "full.ckpt", map_location="meta", weights_only=True)
    assert {t.device.type for t in meta["state_dict"].values()} == {"meta"}
    assert meta["optimizer_states"][0]["state"][0]["exp_avg"].device == reference["optimizer_states"][0]["state"][0][
        "exp_avg"].device
    seen: list[str] = []
    kept = VitScaleCheckpointIO().load_checkpoint(
        saved / "sharded.ckpt", map_location=lambda storage, tag: seen.append(tag)
    )
    assert set(seen) == {"cpu"} and all(t.device.type == "cpu" for t in kept["state_dict"].values())


def test_a_single_device_fit_resumes_from_the_folder_like_from_the_full_file(saved):
    losses = {}
    for name in ("full.ckpt", "sharded.ckpt"):
        L.seed_everything(0, verbose=False)
        model = Classifier("encoder")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer("auto", 8, [VitScaleCheckpointIO()]).fit(model, loader(n=32), ckpt_path=saved / name)
        losses[name] = model.losses
    assert len(losses["full.ckpt"]) == 4  # steps 5-8: the loop state came back
    assert losses["sharded.ckpt"] == losses["full.ckpt"]  # and the optimizer's moments and the scheduler's LR


def test_a_weights_only_folder_refuses_to_resume_a_fit_as_a_weights_only_file_does(saved):
    assert "optimizer_states" not in VitScaleCheckpointIO().load_checkpoint(saved / "weights-only.ckpt")
    with pytest.raises(KeyError, match="save_weights_only"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer("auto", 8, [VitScaleCheckpointIO()])
        trainer.fit(Classifier("encoder"), loader(n=32), ckpt_path=saved / "weights-only.ckpt")
    assert_same_model(Classifier.load_from_checkpoint(consolidated(saved / "weights-only.ckpt")),
                      Classifier.load_from_checkpoint(saved / "full.ckpt"))


def test_crafted_pickles_in_a_folder_never_run_through_load_from_checkpoint(saved, tmp_path):
    marker = tmp_path / "pwned"
    meta_case, dcp_case = tmp_path / "meta.ckpt", tmp_path / "dcp.ckpt"
    for folder in (meta_case, dcp_case):
        shutil.copytree(saved / "sharded.ckpt", folder)
    meta = torch.load(meta_case / "meta.pt", weights_only=True)
    meta["hyper_parameters"]["backbone"] = Payload(marker)
    torch.save(meta, meta_case / "meta.pt")
    dcp_meta = pickle.loads((dcp_case / ".metadata").read_bytes())
    dcp_meta.planner_data["x"] = Payload(marker)
    (dcp_case / ".metadata").write_bytes(pickle.dumps(dcp_meta))
    for folder in (meta_case, dcp_case):  # whoever crafts a file can rewrite its CRC-32 too
        restamp(folder)
    with pytest.raises(CheckpointError, match=r"refuses \(posix.system\).*weights_only=False"):
        Classifier.load_from_checkpoint(consolidated(meta_case))
    with pytest.raises(CheckpointError, match="refers to posix.system.*refusing"):
        VitScaleCheckpointIO().load_checkpoint(dcp_case, weights_only=True)
    assert not marker.exists()
    with pytest.raises(KeyError):  # the opt-in for trusted files really unpickles: backbone=0, the payload's result
        Classifier.load_from_checkpoint(consolidated(meta_case, weights_only=False), weights_only=False)
    assert marker.exists()


def test_folders_that_are_not_ours_fail_as_lightning_fails(saved, tmp_path):
    foreign = tmp_path / "foreign.ckpt"
    shutil.copytree(saved / "sharded.ckpt", foreign)
    (foreign / "lightning_vitscale.json").unlink()  # e.g. Lightning's own FSDP folder: DCP shards + meta.pt
    for folder in (foreign, tmp_path):
        assert not is_sharded_checkpoint(folder)
        with pytest.raises(IsADirectoryError):
            VitScaleCheckpointIO().load_checkpoint(folder)  # Lightning's TorchCheckpointIO answers
    with pytest.raises(IsADirectoryError):  # Lightning's own loader, untouched: the folder needs consolidated()
        Classifier.load_from_checkpoint(saved / "sharded.ckpt")
    assert is_sharded_checkpoint(saved / "sharded.ckpt") and is_sharded_checkpoint(URL)
    assert not is_sharded_checkpoint(saved / "full.ckpt") and not is_sharded_checkpoint("memory://nowhere")
