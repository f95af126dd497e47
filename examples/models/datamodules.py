"""DataModules for the classification example: real digits and a user folder of images.

Detection data lives in ``coco.py`` / ``shapes_coco.py``, video data in ``video_files.py`` / ``shapes_video.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from examples.models.loading import make_loader


def normalisation(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and std per channel: ImageNet's for RGB, 0.5 for grey."""
    return ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if channels == 3 else ((0.5,) * channels, (0.5,) * channels)


def image_transforms(img_size: int, channels: int = 3) -> tuple[Callable, Callable]:
    """Train (random resized crop, flip) and validation (resize, centre crop) transforms of a PIL image, normalised
    with ImageNet's mean and std (grey images: to [-1, 1]); shared by the folder and the tar-shard datamodules."""
    from torchvision import transforms as T

    norm = T.Normalize(*normalisation(channels))
    train_tf = T.Compose([T.RandomResizedCrop(img_size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(int(img_size * 1.14)), T.CenterCrop(img_size), T.ToTensor(), norm])
    return train_tf, val_tf


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

    ``label_fraction`` (0 < f <= 1) trains on that fraction of the training split's labels, the semi-supervised
    setting of a fine-tuning table: a class-stratified subset (``round(f * n)`` of each class's ``n`` images, at
    least one) chosen by ``seed`` alone, so every rank, strategy and run holds the same one; validation is unchanged.
    """

    num_classes = 10
    in_chans = 1

    def __init__(
        self, img_size: int = 16, batch_size: int = 32, num_workers: int | None = None, seed: int = 0,
        label_fraction: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__(batch_size, num_workers)
        if not 0.0 < label_fraction <= 1.0:
            raise ValueError(
                f"--data.label_fraction={label_fraction} must be in (0, 1]: the share of the training labels to"
                " train on (e.g. 0.1 for 10%; 1.0, the default, for all)."
            )
        self.img_size = img_size
        self.seed = seed
        self.label_fraction = label_fraction

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        xt = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 8.0 - 1.0  # pixel range 0..16 -> [-1, 1]
        if self.img_size != 8:
            xt = torch.nn.functional.interpolate(xt, size=self.img_size, mode="bilinear", align_corners=False)
        yt = torch.tensor(y, dtype=torch.long)
        tr, va = train_test_split(range(len(y)), test_size=0.2, stratify=y, random_state=self.seed)
        if self.label_fraction < 1.0:
            tr = labelled_subset(yt[tr], self.label_fraction, self.seed, torch.tensor(tr)).tolist()
        self.train_set = TensorDataset(xt[tr], yt[tr])
        self.val_set = TensorDataset(xt[va], yt[va])


def labelled_subset(labels: torch.Tensor, fraction: float, seed: int, index: torch.Tensor) -> torch.Tensor:
    """``index``'s entries kept at ``fraction`` of the labels: per class, ``round(fraction * n)`` (at least one) of
    its ``n`` entries drawn by a generator seeded with ``seed`` alone (not the global RNG: the same on every rank),
    in their original order."""
    generator = torch.Generator().manual_seed(seed)
    keep = []
    for c in labels.unique().tolist():  # sorted: the draws happen in the same order every time
        members = (labels == c).nonzero().flatten()
        k = max(1, round(fraction * len(members)))
        keep.append(members[torch.randperm(len(members), generator=generator)[:k]])
    return index[torch.cat(keep).sort().values]


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

        train_tf, val_tf = image_transforms(self.img_size)
        self.train_set = datasets.ImageFolder(f"{self.root}/train", train_tf)
        self.val_set = datasets.ImageFolder(f"{self.root}/val", val_tf)
