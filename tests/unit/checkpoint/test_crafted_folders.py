"""Crafted sharded folders against every load path, in one process: a pickle that DCP's metadata declares as a
stored value (here for an EMA tensor) never runs, and no storage path reads a file outside the folder.

Variants (each a copy of one real ``ShardedEMA`` checkpoint):
- ``ema_bytes``: ``.metadata`` (only DCP classes: it passes the restricted unpickler) declares an EMA tensor a
  pickled value stored in bytes appended to a shard; DCP's default planner would unpickle it with
  ``weights_only=False``.
- ``traversal`` / ``absolute``: every storage ``relative_path`` names a copy of the shard outside the folder
  (``../..``, or an absolute path): DCP would read it into the weights without a word.
- ``symlink``: the shard itself is a symlink to that outside copy.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lightning_vitscale import CheckpointError, ShardedEMA, VitScaleCheckpointIO, VitScaleStrategy, consolidated
from lightning_vitscale.__main__ import main
from lightning_vitscale._compat import StorageInfo
from lightning_vitscale.checkpoint.formats import EMA_KEY, sharded_entries
from lightning_vitscale.checkpoint.storage import Location
from tests.helpers.exploit import Payload
from tests.helpers.models import Classifier, loader
from tests.helpers.saved_runs import restamp

SHARD = "__0_0.distcp"
VARIANTS = ("ema_bytes", "traversal", "absolute", "symlink")
OUTSIDE = "refusing to read outside the folder"


def make_trainer(strategy, steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=2, enable_checkpointing=False, **kwargs)


def rewrite_metadata(folder: Path, change) -> None:
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def craft_ema_bytes(folder: Path, value) -> None:
    """The first EMA tensor declared a pickled value: ``value`` saved and appended to a shard."""

    def declare_bytes(metadata) -> None:
        key = next(k for k in metadata.state_dict_metadata if k.startswith(EMA_KEY + "."))
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        payload = _saved(value)
        offset = (folder / SHARD).stat().st_size
        with open(folder / SHARD, "ab") as shard:
            shard.write(payload)
        metadata.storage_data[MetadataIndex(key)] = StorageInfo(SHARD, offset, len(payload))

    rewrite_metadata(folder, declare_bytes)


def _saved(value) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def craft_paths(folder: Path, target: str) -> None:
    def point_outside(metadata) -> None:
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = StorageInfo(target, info.offset, info.length, info.transform_descriptors)

    rewrite_metadata(folder, point_outside)


@pytest.fixture(scope="module")
def crafted(tmp_path_factory, mesh) -> dict[str, Path]:
    """One 2-step fit with ShardedEMA saved as a sharded folder, and the crafted copies of it."""
    out = tmp_path_factory.mktemp("crafted")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.seed_everything(0, verbose=False)
        trainer = make_trainer(VitScaleStrategy(), 2, callbacks=[ShardedEMA()])
        trainer.fit(Classifier("encoder"), loader(n=8))
        trainer.save_checkpoint(out / "good.ckpt")
    (out / "elsewhere").mkdir()
    outside = out / "elsewhere" / "x.distcp"
    shutil.copy(out / "good.ckpt" / SHARD, outside)
    folders = {name: out / "crafted" / f"{name}.ckpt" for name in VARIANTS}
    for folder in folders.values():
        shutil.copytree(out / "good.ckpt", folder)
    craft_ema_bytes(folders["ema_bytes"], Payload(out / "pwned"))
    craft_paths(folders["traversal"], "../../elsewhere/x.distcp")
    craft_paths(folders["absolute"], str(outside))
    (folders["symlink"] / SHARD).unlink()
    (folders["symlink"] / SHARD).symlink_to(outside)
    for folder in folders.values():  # whoever crafts a folder can rewrite its CRC-32s too
        restamp(folder)
    return {"good": out / "good.ckpt", "marker": out / "pwned", **folders}


def expected_error(variant: str) -> str:
    return "stores ema_state_dict.* as a pickled value|weights_only=True refuses" if variant == "ema_bytes" else OUTSIDE


def refused(crafted: dict[str, Path], variant: str, attempt) -> None:
    """``attempt(folder)`` fails with a CheckpointError naming the cause, and no payload ran."""
    with pytest.raises(CheckpointError, match=expected_error(variant)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attempt(crafted[variant])
    assert not crafted["marker"].exists()


each_variant = pytest.mark.parametrize("variant", VARIANTS)


@each_variant
def test_a_fit_resume_under_the_strategy_refuses(crafted, variant):
    def fit(folder: Path) -> None:
        trainer = make_trainer(VitScaleStrategy(), 4, callbacks=[ShardedEMA()])
        trainer.fit(Classifier("encoder"), loader(n=16), ckpt_path=folder)

    refused(crafted, variant, fit)


@each_variant
def test_validate_with_a_checkpoint_refuses(crafted, variant):
    def validate(folder: Path) -> None:
        make_trainer(VitScaleStrategy(), 4, callbacks=[ShardedEMA()]).validate(
            Classifier("encoder"), loader(n=8), ckpt_path=folder)

    refused(crafted, variant, validate)


@each_variant
def test_the_sharded_entries_api_refuses(crafted, variant):
    ema = VitScaleCheckpointIO().load_checkpoint(crafted["good"])[EMA_KEY]
    targets = {k: torch.zeros_like(v) for k, v in ema.items()}

    def load(folder: Path) -> None:
        sharded_entries(Location.of(folder))[EMA_KEY].load_into(dict(targets))

    refused(crafted, variant, load)
    sharded_entries(Location.of(crafted["good"]))[EMA_KEY].load_into(targets)  # the real folder loads
    assert all(bool(t.abs().sum()) for t in targets.values() if t.is_floating_point())


@each_variant
def test_load_from_checkpoint_and_a_single_device_resume_refuse(crafted, variant):
    refused(crafted, variant, lambda folder: Classifier.load_from_checkpoint(consolidated(folder)))
    refused(crafted, variant, lambda folder: make_trainer("auto", 4, plugins=[VitScaleCheckpointIO()]).fit(
        Classifier(), loader(n=16), ckpt_path=folder))  # DDP's route to a sharded folder


@each_variant
def test_consolidate_refuses(crafted, variant, tmp_path, capsys):
    assert main(["consolidate", str(crafted[variant]), str(tmp_path / "out.ckpt")]) == 1
    assert not crafted["marker"].exists() and not (tmp_path / "out.ckpt").exists()
    error = capsys.readouterr().err
    assert error.startswith("error: ") and str(crafted[variant]) in error
    if variant != "ema_bytes":  # --unsafe is about pickles: the folder stays the limit
        assert main(["consolidate", "--unsafe", str(crafted[variant]), str(tmp_path / "out.ckpt")]) == 1
        assert OUTSIDE in capsys.readouterr().err


def test_only_the_unsafe_opt_out_runs_the_payload(crafted, tmp_path):
    assert main(["consolidate", "--unsafe", str(crafted["ema_bytes"]), str(tmp_path / "out.ckpt")]) == 0
    assert crafted["marker"].exists()  # the opt-out for trusted files really unpickles
    crafted["marker"].unlink()


def test_a_tensor_declared_as_a_pickled_value_is_refused_not_silently_skipped(crafted, tmp_path):
    """A safe pickle (a tensor) in place of an EMA tensor: DCP would put it in its dict and leave the EMA as it was."""
    folder = tmp_path / "tensor_bytes.ckpt"
    shutil.copytree(crafted["good"], folder)
    craft_ema_bytes(folder, torch.ones(3))
    ema = VitScaleCheckpointIO().load_checkpoint(crafted["good"])[EMA_KEY]
    targets = {k: torch.zeros_like(v) for k, v in ema.items()}
    with pytest.raises(CheckpointError, match=r"stores ema_state_dict\.\S+ as a pickled value, not as a tensor"):
        sharded_entries(Location.of(folder))[EMA_KEY].load_into(targets)
