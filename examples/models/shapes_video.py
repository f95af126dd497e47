"""The video example's built-in data: generated moving shapes written once as mp4 files, then read like yours.

Each clip shows one square or disk moving in a straight line over a static noise background; the label is one
of ``num_classes`` directions. Clips are encoded with H.264 (lossless: crf 0, 4:4:4 chroma) into the class-folder
layout ``<cache>/<key>/{train,val}/direction_KK/NNNNNN.mp4``, so the default run decodes them with the same
PyAV reader, sampling and transforms a user's Kinetics-style mp4 files go through.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from examples.models.video_files import VideoDataModule
from examples.models.written_data import WrittenOnce, cache_root


def moving_shapes(
    n: int, size: int, frames: int, num_classes: int, speed: float, g: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``n`` uint8 clips (n, T, 3, S, S) and their direction labels; paths stay inside the frame."""
    labels = torch.randint(0, num_classes, (n,), generator=g)
    angle = labels.float() * (2 * math.pi / num_classes)
    vx, vy = speed * torch.cos(angle), speed * torch.sin(angle)
    radius = 3 + 3 * torch.rand(n, generator=g)
    margin = radius + speed * (frames - 1) / 2
    cx0 = size / 2 + (torch.rand(n, generator=g) * 2 - 1) * (size / 2 - margin).clamp(min=0) - vx * (frames - 1) / 2
    cy0 = size / 2 + (torch.rand(n, generator=g) * 2 - 1) * (size / 2 - margin).clamp(min=0) - vy * (frames - 1) / 2
    square = torch.rand(n, generator=g) < 0.5
    colour = 0.4 + 0.6 * torch.rand(n, 3, generator=g)
    ti = torch.arange(frames, dtype=torch.float32)
    cx, cy = cx0[:, None] + vx[:, None] * ti, cy0[:, None] + vy[:, None] * ti  # (n, t)
    grid = torch.arange(size, dtype=torch.float32) + 0.5
    dx = (grid[None, None, None, :] - cx[..., None, None]).abs()  # (n, t, 1, s)
    dy = (grid[None, None, :, None] - cy[..., None, None]).abs()  # (n, t, s, 1)
    r = radius[:, None, None, None]
    mask = torch.where(square[:, None, None, None], (dx <= r) & (dy <= r), dx**2 + dy**2 <= r**2)
    video = (torch.rand(n, 1, 3, size, size, generator=g) * 0.3).expand(n, frames, 3, size, size)
    video = torch.where(mask[:, :, None], colour[:, None, :, None, None], video)
    return (video * 255).round().to(torch.uint8), labels


def write_mp4(path: Path, clip: Tensor, fps: int = 8) -> None:
    """uint8 (T, 3, H, W) -> lossless H.264 mp4 (yuv444p, crf 0), the container/codec Kinetics files use."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = clip.shape[-1], clip.shape[-2], "yuv444p"
        stream.options = {"crf": "0", "preset": "ultrafast"}
        for frame in clip.permute(0, 2, 3, 1).numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())


class MovingShapesVideoDataModule(WrittenOnce, VideoDataModule):
    """Generated moving-shape clips (the default): written once to ``cache_dir`` as mp4 class folders.

    Pixels are normalised with mean = std = 0.5, i.e. to [-1, 1] (in [0, 1] the ViT failed to learn at all).
    """

    def __init__(
        self,
        img_size: int = 32,
        num_frames: int = 8,
        num_classes: int = 8,
        num_train: int = 2000,
        num_val: int = 256,
        speed: float = 2.0,
        batch_size: int = 32,
        num_workers: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
        keep_decoded: bool | None = None,
    ) -> None:
        self.n_classes, self.speed, self.seed = num_classes, speed, seed
        self.splits = {"train": num_train, "val": num_val}
        params = {"size": img_size, "frames": num_frames, "classes": num_classes, "speed": speed, "seed": seed}
        root = cache_root(cache_dir, "shapes-video", {**params, **self.splits})
        super().__init__(
            str(root),
            num_frames=num_frames,
            img_size=img_size,
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
            batch_size=batch_size,
            num_workers=num_workers,
            keep_decoded=keep_decoded,
        )

    @property
    def num_classes(self) -> int:
        return self.n_classes

    def _write(self, tmp: Path) -> None:
        g = torch.Generator().manual_seed(self.seed)
        for split, n in self.splits.items():
            clips, labels = moving_shapes(n, self.img_size, self.num_frames, self.n_classes, self.speed, g)
            for k in range(self.n_classes):
                (tmp / split / f"direction_{k:02d}").mkdir(parents=True)
            for i, (clip, label) in enumerate(zip(clips, labels.tolist())):
                write_mp4(tmp / split / f"direction_{label:02d}" / f"{i:06d}.mp4", clip)
