"""Video files: the generated default written as mp4 and decoded back, hand-made class folders and a CSV list."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from examples.models.shapes_video import MovingShapesVideoDataModule, moving_shapes, write_mp4
from examples.models.video_files import VideoDataModule, read_clip

pytestmark = pytest.mark.timeout(120)


def test_default_is_written_as_mp4_and_decodes_back_to_the_generated_clips(tmp_path: Path) -> None:
    dm = MovingShapesVideoDataModule(
        img_size=32, num_frames=8, num_train=6, num_val=4, cache_dir=str(tmp_path), num_workers=0
    )
    dm.prepare_data()
    files = sorted(dm.root.glob("val/direction_*/*.mp4"))
    assert len(files) == 4 and dm.num_classes == 8
    g = torch.Generator().manual_seed(0)
    moving_shapes(6, 32, 8, 8, 2.0, g)  # the train split comes first from the same generator
    clips, labels = moving_shapes(4, 32, 8, 8, 2.0, g)
    dm.setup()
    by_name = {p.name: p for p in files}
    for i in range(4):
        path = by_name[f"{i:06d}.mp4"]
        assert path.parent.name == f"direction_{int(labels[i]):02d}"
        decoded = read_clip(path, 8).int()
        assert (decoded - clips[i].int()).abs().float().mean() < 1.0, "lossless H.264 round trip (colour rounding)"
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 8, 3, 32, 32) and x.min() >= -1 and x.max() <= 1
    assert sorted(y.tolist()) == sorted(labels.tolist())


def _clip(frames: int, h: int, w: int) -> torch.Tensor:
    """Frame k has brightness 20 * k, so a decoded frame tells which source frame it came from."""
    return (torch.arange(frames) * 20).view(-1, 1, 1, 1).expand(frames, 3, h, w).to(torch.uint8).contiguous()


def _user_videos(root: Path) -> None:
    for split in ("train", "val"):
        for c, name in enumerate(("cat", "dog")):
            (root / split / name).mkdir(parents=True)
            write_mp4(root / split / name / f"clip {c}.mp4", _clip(12, 48, 64))


def test_user_class_folders_sample_frames_uniformly_and_crop(tmp_path: Path) -> None:
    _user_videos(tmp_path)
    (tmp_path / "train" / "dog" / "notes.txt").write_text("not a video")
    dm = VideoDataModule(str(tmp_path), num_frames=4, img_size=32, mean=(0, 0, 0), std=(1, 1, 1), num_workers=0)
    assert dm.num_classes == 2
    dm.setup()
    assert len(dm.train_set) == 2  # type: ignore[arg-type]
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (2, 4, 3, 32, 32) and y.tolist() == [0, 1]
    brightness = (x[0].mean(dim=(1, 2, 3)) * 255 / 20).round().tolist()
    assert brightness == [0, 4, 7, 11], "frames 0, 11/3, 22/3, 11 of 12 (uniform sampling)"


def test_user_csv_list(tmp_path: Path) -> None:
    _user_videos(tmp_path)
    (tmp_path / "train.csv").write_text("train/cat/clip 0.mp4 0\ntrain/dog/clip 1.mp4,2\n\n")
    (tmp_path / "val.csv").write_text("val/dog/clip 1.mp4 1\n")
    dm = VideoDataModule(str(tmp_path), layout="list", num_frames=2, img_size=48, num_workers=0, batch_size=2)
    assert dm.num_classes == 3
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 2, 3, 48, 48) and sorted(y.tolist()) == [0, 2]
    (tmp_path / "val.csv").write_text("val/dog/clip 1.mp4 dog\n")
    with pytest.raises(ValueError, match=r"val.csv:1: expected '<path> <integer label>'"):
        dm.setup()


def test_missing_video_folder_names_the_layout(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"expected ROOT/<split>/<class>/<video files>"):
        _ = VideoDataModule(str(tmp_path)).num_classes
    with pytest.raises(ValueError, match="layout='csv'"):
        VideoDataModule(str(tmp_path), layout="csv")  # type: ignore[arg-type]


def test_keep_decoded_reads_each_file_once_and_gives_the_values_a_read_gives(tmp_path: Path) -> None:
    _user_videos(tmp_path)
    dms = {keep: VideoDataModule(str(tmp_path), num_frames=4, img_size=32, keep_decoded=keep) for keep in (True, False)}
    for dm in dms.values():
        dm.setup()
    clips = {}
    for keep, dm in dms.items():
        torch.manual_seed(0)  # the same random crops
        clips[keep] = [dm.train_set[i][0] for i in range(2)] + [dm.val_set[i][0] for i in range(2)]  # type: ignore[index]
    for kept, read in zip(clips[True], clips[False], strict=True):
        assert torch.equal(kept, read)
    for path in tmp_path.rglob("*.mp4"):
        path.unlink()
    assert dms[True].train_set[1][1] == 1  # type: ignore[index]  # served from memory: the files are gone
    with pytest.raises(Exception, match="clip 1.mp4"):
        dms[False].train_set[1]  # type: ignore[index]  # read from its file every time
    assert dms[True].train_dataloader().num_workers == 0  # nothing left to decode: no loader worker by default


def test_keep_decoded_default_keeps_what_fits_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _user_videos(tmp_path)  # 4 clips; 4 frames of 48x64 resized to 32x42: 4 * 3 * 32 * 42 bytes each
    dm = VideoDataModule(str(tmp_path), num_frames=4, img_size=32, num_workers=0)
    budget = 4 * (4 * 3 * 32 * 42)
    choices = ((budget, True, "keeping them in memory"), (budget - 1, False, "reading the 4 clips from their files"))
    for max_bytes, kept, logged in choices:
        monkeypatch.setattr("examples.models.video_files.KEEP_DECODED_MAX_BYTES", max_bytes)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            dm.setup()
        assert dm.kept_decoded is kept and (dm.train_set.kept is not None) is kept  # type: ignore[union-attr]
        assert logged in caplog.text, "the choice is logged, with the flag that overrides it"
