"""Multi-crop data for self-supervised pretraining: a few global and local crops per image, plus k-NN loaders.

Training batches are ``(crops, labels)`` with ``crops`` a list of ``n_global + n_local`` tensors (global crops
first, the order the DINO loss expects); labels are never used for training. Validation has two loaders: the
training images un-augmented (the k-NN feature bank) and the validation images (the queries).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from examples.models.datamodules import DigitsDataModule, FolderImageDataModule

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class MultiCrop:
    """``n_global`` crops at ``img_size`` covering much of the image, ``n_local`` small ones at ``local_size``."""

    def __init__(
        self, img_size: int, local_size: int, n_global: int, n_local: int, global_scale: tuple[float, float],
        local_scale: tuple[float, float], flip: bool, prepare: Any = None,
    ) -> None:  # fmt: skip
        jitter = [v2.RandomHorizontalFlip()] if flip else []
        self.prepare = prepare or v2.Identity()
        self.global_tf = v2.Compose([v2.RandomResizedCrop(img_size, global_scale, antialias=True), *jitter])
        self.local_tf = v2.Compose([v2.RandomResizedCrop(local_size, local_scale, antialias=True), *jitter])
        self.n_global, self.n_local = n_global, n_local

    def __call__(self, image: Any) -> list[Tensor]:
        image = self.prepare(image)
        return [self.global_tf(image) for _ in range(self.n_global)] + [
            self.local_tf(image) for _ in range(self.n_local)
        ]


class MultiCropDataset(Dataset):
    """Wraps an ``(image, label)`` dataset, returning ``(crops, label)``."""

    def __init__(self, base: Dataset, crops: MultiCrop) -> None:
        self.base, self.crops = base, crops

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[list[Tensor], Any]:
        image, label = self.base[i]
        return self.crops(image), label


class _MultiCropLoaders:
    """Validation loaders of a pretraining datamodule: ``train_plain`` (the training split un-augmented) for the
    k-NN bank, then the validation split; ``train_set`` yields the crops."""

    crops: MultiCrop
    train_plain: Dataset | None = None
    val_set: Dataset | None

    def val_dataloader(self) -> list[DataLoader]:  # _loader: the datamodule's (examples/models/datamodules.py)
        loader = self._loader  # type: ignore[attr-defined]
        return [loader(self.train_plain, False), loader(self.val_set, False)]


class DigitsMultiCropDataModule(_MultiCropLoaders, DigitsDataModule):
    """scikit-learn digits (16 px) with 2 global crops (16 px) and ``n_local`` local crops (8 px); no download."""

    def __init__(
        self, n_global: int = 2, n_local: int = 4, local_size: int = 8, img_size: int = 16, batch_size: int = 16,
        num_workers: int | None = None, seed: int = 0, global_scale: tuple[float, float] = (0.5, 1.0),
        local_scale: tuple[float, float] = (0.2, 0.5),
    ) -> None:  # fmt: skip
        super().__init__(img_size, batch_size, num_workers, seed)
        self.n_global, self.n_local, self.local_size = n_global, n_local, local_size
        # no flips: a mirrored 2 or 5 is another digit (or none); the crops carry the invariance
        self.crops = MultiCrop(img_size, local_size, n_global, n_local, global_scale, local_scale, flip=False)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        assert self.train_set is not None
        self.train_plain, self.train_set = self.train_set, MultiCropDataset(self.train_set, self.crops)


class FolderMultiCropDataModule(_MultiCropLoaders, FolderImageDataModule):
    """Your own ImageFolder tree (``root/train/<class>/*``, ``root/val/<class>/*``; classes only for k-NN)."""

    def __init__(
        self, root: str, n_global: int = 2, n_local: int = 10, local_size: int = 96, img_size: int = 224,
        batch_size: int = 64, num_workers: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(root, img_size, batch_size, num_workers)
        self.n_global, self.n_local, self.local_size = n_global, n_local, local_size
        prepare = v2.Compose(
            [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        )
        self.crops = MultiCrop(img_size, local_size, n_global, n_local, (0.4, 1.0), (0.05, 0.4), True, prepare)

    def setup(self, stage: str | None = None) -> None:
        from torchvision import datasets

        super().setup(stage)  # val_set: resized + centre-cropped, the transform the k-NN bank uses too
        assert self.val_set is not None
        self.train_plain = datasets.ImageFolder(f"{self.root}/train", self.val_set.transform)  # type: ignore[attr-defined]
        self.train_set = datasets.ImageFolder(f"{self.root}/train", self.crops)  # (crops, label) per image
