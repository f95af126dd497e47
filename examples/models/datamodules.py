"""DataModules for the examples: real digits, a user folder of images, generated shapes (detection/video).

Generated datasets are built from a seeded ``torch.Generator`` so every process (and every run) sees
the same data without downloads; the distributed sampler Lightning injects does the rank split.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from examples.models.loading import make_loader


class _TensorDataModule(pl.LightningDataModule):
    """Common loader plumbing; DataLoader defaults per accelerator come from ``examples.models.loading``."""

    in_memory = True  # ready tensors: no loader worker by default (see ``loading.loader_settings``)

    def __init__(self, batch_size: int, num_workers: int | None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _loader(self, ds: Dataset | None, shuffle: bool, collate: Callable | None = None) -> DataLoader:
        assert ds is not None, "setup() not called"
        return make_loader(ds, self.batch_size, shuffle, self.trainer, self.in_memory, self.num_workers, collate)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)


class DigitsDataModule(_TensorDataModule):
    """scikit-learn ``load_digits``: 1797 real 8x8 grey digits, 10 classes, stratified 80/20 split.

    Upsampled to ``img_size`` (16 by default): 4x4 patches of the smoothed image train a ViT better
    than 2x2 patches of the raw 8x8 one (measured ~0.97 vs ~0.95 val acc).
    """

    num_classes = 10
    in_chans = 1

    def __init__(self, img_size: int = 16, batch_size: int = 32, num_workers: int | None = None, seed: int = 0) -> None:
        super().__init__(batch_size, num_workers)
        self.img_size = img_size
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        xt = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 8.0 - 1.0  # pixel range 0..16 -> [-1, 1]
        if self.img_size != 8:
            xt = torch.nn.functional.interpolate(xt, size=self.img_size, mode="bilinear", align_corners=False)
        yt = torch.tensor(y, dtype=torch.long)
        tr, va = train_test_split(range(len(y)), test_size=0.2, stratify=y, random_state=self.seed)
        self.train_set = TensorDataset(xt[tr], yt[tr])
        self.val_set = TensorDataset(xt[va], yt[va])


class FolderImageDataModule(_TensorDataModule):
    """Your own data in torchvision ``ImageFolder`` layout: ``root/train/<class>/*.jpg`` and ``root/val/...``."""

    in_chans = 3
    in_memory = False  # JPEG decoding and augmentation: worth loader workers

    def __init__(self, root: str, img_size: int = 224, batch_size: int = 64, num_workers: int | None = None) -> None:
        super().__init__(batch_size, num_workers)
        from torchvision.datasets.folder import find_classes

        self.root = root
        self.img_size = img_size
        self.num_classes = len(find_classes(f"{root}/train")[0])  # known before setup so the CLI can link it

    def setup(self, stage: str | None = None) -> None:
        from torchvision import datasets
        from torchvision import transforms as T

        norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        train_tf = T.Compose([T.RandomResizedCrop(self.img_size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        val_tf = T.Compose([T.Resize(int(self.img_size * 1.14)), T.CenterCrop(self.img_size), T.ToTensor(), norm])
        self.train_set = datasets.ImageFolder(f"{self.root}/train", train_tf)
        self.val_set = datasets.ImageFolder(f"{self.root}/val", val_tf)


def _shape_mask(kind: int, cx: float, cy: float, w: float, h: float, yy: Tensor, xx: Tensor) -> Tensor:
    """Boolean mask of a rectangle (0), ellipse (1) or triangle (2) with the given box centre/size."""
    dx, dy = (xx - cx) / (w / 2), (yy - cy) / (h / 2)
    if kind == 0:
        return (dx.abs() <= 1) & (dy.abs() <= 1)
    if kind == 1:
        return dx**2 + dy**2 <= 1
    return (dy <= 1) & (dx.abs() <= (dy + 1) / 2)  # apex up, base at the bottom of the box


class ShapesDetectionDataModule(_TensorDataModule):
    """Generated detection set: 1-3 coloured rectangles/ellipses/triangles on noise, boxes in xyxy pixels.

    Pixels are scaled to [-1, 1] (zero-centred inputs train ViTs markedly better than [0, 1]).
    """

    num_classes = 3
    in_chans = 3

    def __init__(
        self,
        img_size: int = 64,
        num_train: int = 2000,
        num_val: int = 256,
        min_size: int = 8,
        max_size: int = 32,
        max_objects: int = 3,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.img_size, self.num_train, self.num_val = img_size, num_train, num_val
        self.min_size, self.max_size, self.max_objects, self.seed = min_size, max_size, max_objects, seed

    def _make(self, n: int, g: torch.Generator) -> list[tuple[Tensor, dict[str, Tensor]]]:
        s = self.img_size
        yy, xx = torch.meshgrid(torch.arange(s) + 0.5, torch.arange(s) + 0.5, indexing="ij")
        out = []
        for _ in range(n):
            img = torch.rand(3, s, s, generator=g) * 0.3
            k = int(torch.randint(1, self.max_objects + 1, (1,), generator=g))
            boxes, labels = [], []
            for _ in range(k):
                w, h = (torch.randint(self.min_size, self.max_size + 1, (2,), generator=g)).tolist()
                x0 = float(torch.randint(0, s - w + 1, (1,), generator=g))
                y0 = float(torch.randint(0, s - h + 1, (1,), generator=g))
                cls = int(torch.randint(0, self.num_classes, (1,), generator=g))
                colour = 0.4 + 0.6 * torch.rand(3, 1, 1, generator=g)
                m = _shape_mask(cls, x0 + w / 2, y0 + h / 2, w, h, yy, xx)
                img = torch.where(m, colour, img)  # later shapes may occlude earlier ones, like real scenes
                boxes.append([x0, y0, x0 + w, y0 + h])
                labels.append(cls)
            out.append((img * 2 - 1, {"boxes": torch.tensor(boxes), "labels": torch.tensor(labels)}))
        return out

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.train_set = self._make(self.num_train, g)  # type: ignore[assignment]
        self.val_set = self._make(self.num_val, g)  # type: ignore[assignment]

    @staticmethod
    def collate(batch: list[tuple[Tensor, dict[str, Tensor]]]) -> tuple[Tensor, list[dict[str, Tensor]]]:
        """Stack images; keep per-image target dicts (variable object counts)."""
        return torch.stack([b[0] for b in batch]), [b[1] for b in batch]

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, True, self.collate)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False, self.collate)


class MovingShapesVideoDataModule(_TensorDataModule):
    """Generated clips of one shape moving in a straight line; label = one of ``num_classes`` directions."""

    in_chans = 3

    def __init__(
        self,
        img_size: int = 32,
        num_frames: int = 8,
        num_classes: int = 8,
        num_train: int = 2000,
        num_val: int = 256,
        speed: float = 2.0,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.img_size, self.num_frames, self.num_classes = img_size, num_frames, num_classes
        self.num_train, self.num_val, self.speed, self.seed = num_train, num_val, speed, seed

    def _make(self, n: int, g: torch.Generator) -> TensorDataset:
        s, t = self.img_size, self.num_frames
        labels = torch.randint(0, self.num_classes, (n,), generator=g)
        angle = labels.float() * (2 * math.pi / self.num_classes)
        vx, vy = self.speed * torch.cos(angle), self.speed * torch.sin(angle)
        radius = 3 + 3 * torch.rand(n, generator=g)
        travel = self.speed * (t - 1) / 2  # start so the whole path stays inside the frame
        margin = radius + travel
        cx0 = s / 2 + (torch.rand(n, generator=g) * 2 - 1) * (s / 2 - margin).clamp(min=0) - vx * (t - 1) / 2
        cy0 = s / 2 + (torch.rand(n, generator=g) * 2 - 1) * (s / 2 - margin).clamp(min=0) - vy * (t - 1) / 2
        square = torch.rand(n, generator=g) < 0.5
        colour = 0.4 + 0.6 * torch.rand(n, 3, generator=g)
        ti = torch.arange(t, dtype=torch.float32)
        cx = cx0[:, None] + vx[:, None] * ti  # (n, t)
        cy = cy0[:, None] + vy[:, None] * ti
        grid = torch.arange(s, dtype=torch.float32) + 0.5
        dx = (grid[None, None, None, :] - cx[..., None, None]).abs()  # (n, t, 1, s)
        dy = (grid[None, None, :, None] - cy[..., None, None]).abs()  # (n, t, s, 1)
        r = radius[:, None, None, None]
        disk = dx**2 + dy**2 <= r**2
        box = (dx <= r) & (dy <= r)
        mask = torch.where(square[:, None, None, None], box, disk)  # (n, t, s, s)
        video = (torch.rand(n, 1, 3, s, s, generator=g) * 0.3).expand(n, t, 3, s, s)  # static background
        video = torch.where(mask[:, :, None], colour[:, None, :, None, None], video)
        return TensorDataset(video * 2 - 1, labels)  # zero-centred: in [0, 1] the ViT failed to learn at all

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.train_set = self._make(self.num_train, g)
        self.val_set = self._make(self.num_val, g)
