"""Video classification data from files: class folders of videos, or a ``<path> <label>`` list (pytorchvideo/Kinetics).

Decoding is PyAV's (FFmpeg; torchvision 0.22+ no longer ships a video reader), so mp4/avi/mkv/webm with any
codec FFmpeg knows are read the same way. Each clip is ``num_frames`` frames sampled uniformly over the whole
video (pytorchvideo's ``UniformTemporalSubsample``), the shorter side resized to ``img_size``, then a random
(train) or centre (val) ``img_size`` crop, normalised per channel. Clips come out as (T, C, H, W) floats.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from examples.models.loading import make_loader

VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v")
KEEP_DECODED_MAX_BYTES = 2**30  # keep_decoded=None keeps the decoded clips when they fit in 1 GiB per rank


def uniform_indices(num_available: int, num_frames: int) -> list[int]:
    """``num_frames`` indices spread evenly over 0..num_available-1 (repeating frames of a short video)."""
    return torch.linspace(0, max(num_available - 1, 0), num_frames).round().long().tolist()


def read_clip(path: Path, num_frames: int) -> Tensor:
    """Decode ``path`` with PyAV and sample ``num_frames`` frames uniformly: uint8 (T, 3, H, W).

    Only the sampled frames are converted to RGB, with one reusable converter (per-frame conversion
    dominated the cost: ~0.5 ms a frame against ~0.2 ms to decode one).
    """
    import av
    from av.video.reformatter import VideoReformatter

    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    if not frames:
        raise ValueError(f"{path}: no video frames could be decoded")
    to_rgb = VideoReformatter()
    picked = [to_rgb.reformat(frames[i], format="rgb24").to_ndarray() for i in uniform_indices(len(frames), num_frames)]
    return torch.from_numpy(np.stack(picked)).permute(0, 3, 1, 2)


def folder_items(split_dir: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    """``split_dir/<class>/<video>``: (path, class index) pairs and the sorted class names (ImageFolder's rule)."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"no folder {split_dir}: expected ROOT/<split>/<class>/<video files>")
    classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    items = [
        (p, k)
        for k, c in enumerate(classes)
        for p in sorted((split_dir / c).iterdir())
        if p.suffix.lower() in VIDEO_SUFFIXES
    ]
    if not items:
        raise FileNotFoundError(f"no video files ({', '.join(VIDEO_SUFFIXES)}) under {split_dir}/<class>/")
    return items, classes


def list_items(list_file: Path, video_root: Path) -> list[tuple[Path, int]]:
    """Lines ``<path> <label>`` (space- or comma-separated, label an integer), paths relative to ``video_root``."""
    if not list_file.is_file():
        raise FileNotFoundError(f"no list file {list_file}: expected lines '<path> <integer label>'")
    items = []
    for n, line in enumerate(list_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        match = re.fullmatch(r"\s*(.*?\S)[,\s]+(\d+)\s*", line)  # the last field is the label: paths may hold spaces
        if match is None:
            raise ValueError(f"{list_file}:{n}: expected '<path> <integer label>', got {line!r}")
        items.append((video_root / match[1], int(match[2])))
    if not items:
        raise ValueError(f"{list_file}: no '<path> <integer label>' lines")
    return items


class VideoClips(Dataset):
    """(clip (T, C, H, W) float, label) for each (path, label) item.

    ``resize`` (deterministic: shorter side to ``img_size``) runs on the decoded uint8 frames, ``augment`` (crop,
    floats, normalisation) after it. With ``keep_decoded`` every file is decoded and resized once, here, and the
    uint8 clips stay in memory: each epoch then only augments, starting from the very values a read would give.
    """

    def __init__(
        self, items: list[tuple[Path, int]], num_frames: int, resize: Any, augment: Any, keep_decoded: bool = False
    ) -> None:
        self.items, self.num_frames, self.resize, self.augment = items, num_frames, resize, augment
        self.kept: list[Tensor] | None = [self.decode(i) for i in range(len(items))] if keep_decoded else None

    def decode(self, i: int) -> Tensor:
        """Clip ``i`` read from its file: ``num_frames`` uint8 frames, resized."""
        return self.resize(read_clip(self.items[i][0], self.num_frames))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        clip = self.kept[i] if self.kept is not None else self.decode(i)
        return self.augment(clip), self.items[i][1]


def clip_transforms(img_size: int, train: bool, mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[Any, Any]:
    """(resize, augment): shorter side -> img_size; random (train) / centre (val) square crop, [0, 1], normalise."""
    from torchvision.transforms import v2

    crop = v2.RandomCrop(img_size) if train else v2.CenterCrop(img_size)
    augment = v2.Compose([crop, v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])
    return v2.Resize(img_size), augment


def keep_decoded_by_size(num_clips: int, one_clip: Tensor) -> bool:
    """``keep_decoded=None``'s rule: keep ``num_clips`` clips the size of ``one_clip`` if they fit the budget."""
    max_bytes = KEEP_DECODED_MAX_BYTES
    estimate = one_clip.nbytes * num_clips
    size = f"~{estimate / 2**20:.0f} MiB per rank"
    if estimate <= max_bytes:
        rank_zero_info(f"VideoDataModule: decoding the {num_clips} clips once and keeping them in memory ({size};"
                       " --data.keep_decoded=false reads the files every epoch)")  # fmt: skip
        return True
    rank_zero_info(f"VideoDataModule: reading the {num_clips} clips from their files every epoch (decoded: {size},"
                   f" over {max_bytes / 2**30:g} GiB; --data.keep_decoded=true keeps them anyway)")  # fmt: skip
    return False


class VideoDataModule(pl.LightningDataModule):
    """Your videos: ``layout="folders"``: ``root/<split>/<class>/*.mp4``; ``layout="list"``: ``root/<split>.csv``.

    A list file (``list_file``, ``{split}`` replaced) has one ``<path> <label>`` line per clip, paths relative
    to ``root``, labels ``0..K-1`` (pytorchvideo's ``LabeledVideoDataset`` / Kinetics format). ``num_classes``
    is known at construction (class folders, or the largest label + 1) so the CLI links it into the model.

    ``keep_decoded``: ``True`` decodes every file once in ``setup`` (the sampled frames, resized: uint8) and keeps
    the clips in memory, so later epochs only crop and normalise (and the loader needs no workers); ``False``
    decodes from the files every time a clip is read (datasets the size of Kinetics); ``None`` (default) keeps them
    when all clips, estimated from the first one, fit in ``KEEP_DECODED_MAX_BYTES`` (1 GiB) per rank, and logs
    which it chose. Every rank holds its own copy. The values are the same either way.
    """

    in_chans = 3

    def __init__(
        self,
        root: str,
        layout: Literal["folders", "list"] = "folders",
        list_file: str = "{split}.csv",
        train_split: str = "train",
        val_split: str = "val",
        num_frames: int = 16,
        img_size: int = 224,
        mean: tuple[float, float, float] = (0.45, 0.45, 0.45),
        std: tuple[float, float, float] = (0.225, 0.225, 0.225),
        batch_size: int = 8,
        num_workers: int | None = None,
        keep_decoded: bool | None = None,
    ) -> None:
        super().__init__()
        if layout not in ("folders", "list"):
            raise ValueError(f"layout={layout!r}: choose 'folders' (ROOT/<split>/<class>/) or 'list' (<path> <label>)")
        self.root, self.layout, self.list_file = Path(root), layout, list_file
        self.train_split, self.val_split = train_split, val_split
        self.num_frames, self.img_size, self.mean, self.std = num_frames, img_size, mean, std
        self.batch_size, self.num_workers, self.keep_decoded = batch_size, num_workers, keep_decoded
        self.kept_decoded: bool | None = None  # what setup() chose
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _items(self, split: str) -> list[tuple[Path, int]]:
        if self.layout == "folders":
            return folder_items(self.root / split)[0]
        return list_items(self.root / self.list_file.format(split=split), self.root)

    @property
    def num_classes(self) -> int:
        if self.layout == "folders":
            return len(folder_items(self.root / self.train_split)[1])
        return max(label for _, label in self._items(self.train_split)) + 1

    def setup(self, stage: str | None = None) -> None:
        splits = {"train_set": self._items(self.train_split), "val_set": self._items(self.val_split)}
        self.kept_decoded = self.keep_decoded
        if self.kept_decoded is None:  # the size of one decoded, resized clip tells what all of them would take
            first = splits["train_set"][0][0]
            one = clip_transforms(self.img_size, False, self.mean, self.std)[0](read_clip(first, self.num_frames))
            self.kept_decoded = keep_decoded_by_size(sum(map(len, splits.values())), one)
        for name, items in splits.items():
            resize, augment = clip_transforms(self.img_size, name == "train_set", self.mean, self.std)
            setattr(self, name, VideoClips(items, self.num_frames, resize, augment, self.kept_decoded))

    def _loader(self, ds: Dataset | None, shuffle: bool) -> DataLoader:
        assert ds is not None, "setup() not called"
        # workers / pinned memory per accelerator (``examples.models.loading``): none for clips kept decoded
        return make_loader(ds, self.batch_size, shuffle, self.trainer, bool(self.kept_decoded), self.num_workers, None)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)
