"""Verified checkpoints: every file's size and CRC-32 in the manifest, checked at load and by
``consolidate SRC`` (no DST: only the check); resolution skips what is incomplete or corrupt, saying which and why."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.__main__ import main
from lightning_vitscale.checkpoint import CheckpointError, CheckpointSettings, Location, verify
from lightning_vitscale.checkpoint.lightning.launcher import resolve_ckpt_path
from lightning_vitscale.checkpoint.resume import complete_checkpoints, verified_checkpoint
from lightning_vitscale.checkpoint.save import save_checkpoint
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER
from lightning_vitscale.distributed import RankContext


def save(path, step: int) -> Location:
    checkpoint = {"state_dict": {"w": torch.arange(4096.0) + step}, "global_step": step}
    save_checkpoint(checkpoint, Location.of(path), CheckpointSettings(), lambda: None)
    return Location.of(path)


def shard(folder) -> str:
    return next(p for p in sorted(folder.iterdir()) if p.name.endswith(".distcp")).name


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_crc(tmp_path):
    save(tmp_path / "a.ckpt", 1)
    manifest = json.loads((tmp_path / "a.ckpt" / SHARDED_MARKER).read_text())
    files = {p.name: p.stat().st_size for p in (tmp_path / "a.ckpt").iterdir() if p.name != SHARDED_MARKER}
    assert {name: entry["size"] for name, entry in manifest["files"].items()} == files
    assert manifest["global_step"] == 1 and all(len(e["crc32"]) == 8 for e in manifest["files"].values())


@pytest.mark.parametrize("damage, message", [("flip", "fails its CRC-32 check"), ("truncate", "has 10 bytes")])
def test_a_damaged_shard_fails_loading_and_verify_naming_the_file(tmp_path, capsys, damage, message):
    folder = tmp_path / "a.ckpt"
    save(folder, 1)
    assert main(["consolidate", str(folder)]) == 0 and "verified" in capsys.readouterr().out
    victim = folder / shard(folder)
    flip_byte(victim) if damage == "flip" else victim.write_bytes(victim.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=message) as error:
        verify(Location.of(folder))
    assert str(victim) in str(error.value)
    assert main(["consolidate", str(folder)]) == 1
    err = capsys.readouterr().err
    assert str(victim) in err and message in err


def test_loading_falls_back_to_the_next_intact_candidate_and_says_why(tmp_path):
    old, new = save(tmp_path / "epoch=0.ckpt", 1), save(tmp_path / "epoch=1.ckpt", 2)
    flip_byte(tmp_path / "epoch=1.ckpt" / shard(tmp_path / "epoch=1.ckpt"))
    with pytest.warns(UserWarning, match=r"skipped .*epoch=1.ckpt.*fails its CRC-32 check"):
        assert verified_checkpoint(new, [old], RankContext()) == old
    with pytest.raises(CheckpointError, match="epoch=1.ckpt.*fails its CRC-32 check"):
        verified_checkpoint(new, [], RankContext())


def test_resolution_skips_incomplete_folders_with_a_log_line(tmp_path, caplog):
    save(tmp_path / "epoch=0.ckpt", 1)
    save(tmp_path / "epoch=1.ckpt", 2)
    (tmp_path / "epoch=1.ckpt" / shard(tmp_path / "epoch=1.ckpt")).unlink()  # a checkpoint missing a shard
    save(tmp_path / "epoch=2.ckpt", 3)
    (tmp_path / "epoch=2.ckpt" / SHARDED_MARKER).rename(tmp_path / "x")  # never committed
    (tmp_path / "epoch=2.ckpt").rename(tmp_path / "epoch=2.ckpt.partial")
    with caplog.at_level(logging.INFO):
        found = complete_checkpoints(Location.of(tmp_path), lambda name: name.endswith(".ckpt"))
    assert [Location.of(tmp_path / "epoch=0.ckpt")] == found
    assert "epoch=1.ckpt" in caplog.text and "is missing" in caplog.text
    assert "epoch=2.ckpt.partial" in caplog.text and "never completed" in caplog.text


def resolve_last(folder) -> tuple[str, Trainer]:
    """``fit(ckpt_path="last")``'s choice under the strategy: the path its launcher hands Lightning."""
    trainer = Trainer(
        callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1, strategy=VitScaleStrategy(),
    )
    return resolve_ckpt_path(trainer, "last", trainer.strategy.checkpoints), trainer


def test_last_without_a_complete_copy_resumes_from_the_newest_complete_save_with_a_warning(tmp_path):
    # DDP fails on a damaged last.ckpt; a silent start from scratch (Lightning's answer to "no last*.ckpt") would
    # throw away the run, so the newest complete save in the folder stands in for it.
    save(tmp_path / "step=1.ckpt", 1)
    save(tmp_path / "step=2.ckpt", 2)
    save(tmp_path / "last.ckpt", 2)
    victim = tmp_path / "last.ckpt" / shard(tmp_path / "last.ckpt")
    victim.write_bytes(victim.read_bytes()[:10])
    with pytest.warns(UserWarning, match=r"no complete last.ckpt .*instead: .*step=2.ckpt"):
        path, trainer = resolve_last(tmp_path)
    assert path == str(tmp_path / "step=2.ckpt")
    assert trainer.strategy.checkpoints.resume_fallbacks == [Location.of(str(tmp_path / "step=1.ckpt"))]


def test_a_corrupt_last_falls_back_to_the_newest_intact_save_in_its_folder(tmp_path):
    save(tmp_path / "step=1.ckpt", 1)
    save(tmp_path / "step=2.ckpt", 2)
    save(tmp_path / "last.ckpt", 2)
    flip_byte(tmp_path / "last.ckpt" / shard(tmp_path / "last.ckpt"))
    path, trainer = resolve_last(tmp_path)
    assert path == str(tmp_path / "last.ckpt")  # sizes are fine: only the CRC-32 check at load sees the flip
    fallbacks = trainer.strategy.checkpoints.resume_fallbacks
    assert fallbacks == [Location.of(str(tmp_path / n)) for n in ("step=2.ckpt", "step=1.ckpt")]  # older ones
    with pytest.warns(UserWarning, match=r"skipped .*last.ckpt.*fails its CRC-32 check"):
        assert verified_checkpoint(Location.of(path), fallbacks, RankContext()) == fallbacks[0]
