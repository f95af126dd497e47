"""Detection data in COCO format: an image folder + an ``instances_*.json``, as detectron2/torchvision users keep it.

``CocoDetection`` reads the json with the standard library (no pycocotools needed) and decodes images with
``torchvision.io``; transforms are torchvision's ``transforms.v2`` (boxes follow the image): resize the
longer side to ``img_size`` for evaluation, and for training either the same plus a horizontal flip or
large-scale jitter (Ghiasi et al. 2021: random rescale, then a fixed ``img_size`` crop, as ViTDet trains).
Images of different sizes share a batch: ``pad_collate`` pads them to the batch's largest, rounded up to a
multiple of ``size_divisibility`` (detectron2's ``ImageList``); the backbone interpolates its position
embedding to that size. Boxes and metrics stay in the resized image's pixels.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from examples.models.loading import make_loader

Target = dict[str, Tensor]
Batch = tuple[Tensor, list[Target]]


def require_annotations(annotations: Path) -> Path:
    """``annotations`` if it is a file, else the error that names the expected layout and the flags to change it."""
    if not annotations.is_file():
        raise FileNotFoundError(
            f"no COCO annotation file {annotations}: expected ROOT/images/<split>/ and "
            "ROOT/annotations/instances_<split>.json (set --data.images / --data.annotations for another layout)"
        )
    return annotations


def read_categories(annotations: Path) -> list[dict[str, Any]]:
    """The ``categories`` of a COCO json sorted by id; label ``i`` of the model is the i-th of them."""
    return sorted(json.loads(require_annotations(annotations).read_text())["categories"], key=lambda c: c["id"])


class CocoDetection(Dataset):
    """(image, {"boxes": xyxy pixels, "labels": 0..K-1}) per entry of ``images``; crowd boxes skipped."""

    def __init__(self, image_dir: Path, annotations: Path, transform: Any) -> None:
        data = json.loads(annotations.read_text())
        self.label_of = {c["id"]: i for i, c in enumerate(sorted(data["categories"], key=lambda c: c["id"]))}
        per_image: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for ann in data["annotations"]:
            if not ann.get("iscrowd", 0):
                per_image[ann["image_id"]].append(ann)
        images = sorted(data["images"], key=lambda im: im["id"])
        self.items = [(image_dir / im["file_name"], per_image[im["id"]]) for im in images]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Tensor, Target]:
        from torchvision import tv_tensors
        from torchvision.io import ImageReadMode, decode_image

        path, anns = self.items[i]
        img = decode_image(str(path), mode=ImageReadMode.RGB)
        xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1)
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=tuple(img.shape[-2:])),
            "labels": torch.tensor([self.label_of[a["category_id"]] for a in anns], dtype=torch.long),
        }
        img, target = self.transform(tv_tensors.Image(img), target)
        return img.as_subclass(Tensor), {"boxes": target["boxes"].as_subclass(Tensor), "labels": target["labels"]}


def detection_transform(
    img_size: int,
    train: bool,
    lsj_scale: tuple[float, float] | None,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Any:
    """Train: LSJ (rescale by U(lsj_scale), crop/pad to img_size) or resize, + flip; eval: resize longer side."""
    from torchvision.transforms import v2

    if train and lsj_scale is not None:
        fill = [round(255 * m) for m in mean]  # padding becomes ~0 after Normalize, like the collate's padding
        size: list[Any] = [
            v2.ScaleJitter((img_size, img_size), scale_range=lsj_scale),
            v2.RandomCrop(img_size, pad_if_needed=True, fill=fill),  # type: ignore[arg-type]
        ]
    else:
        size = [v2.Resize(size=None, max_size=img_size)]
    flip = [v2.RandomHorizontalFlip()] if train else []
    finish = [v2.SanitizeBoundingBoxes(min_size=1), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(size + flip + finish)


def pad_collate(batch: list[tuple[Tensor, Target]], size_divisibility: int) -> Batch:
    """Zero-pad (after normalisation) to the batch's largest height/width, rounded up to the divisor."""
    h = max(img.shape[-2] for img, _ in batch)
    w = max(img.shape[-1] for img, _ in batch)
    h, w = (math.ceil(v / size_divisibility) * size_divisibility for v in (h, w))
    out = batch[0][0].new_zeros(len(batch), batch[0][0].shape[0], h, w)
    for i, (img, _) in enumerate(batch):
        out[i, :, : img.shape[-2], : img.shape[-1]] = img
    return out, [t for _, t in batch]


class _Collate:
    """Picklable ``pad_collate`` with a fixed divisor (worker processes need to pickle the collate)."""

    def __init__(self, size_divisibility: int) -> None:
        self.size_divisibility = size_divisibility

    def __call__(self, batch: list[tuple[Tensor, Target]]) -> Batch:
        return pad_collate(batch, self.size_divisibility)


class CocoDetectionDataModule(pl.LightningDataModule):
    """Your detection data in COCO format: ``root/images/<split>/*`` + ``root/annotations/instances_<split>.json``.

    ``images`` and ``annotations`` are patterns relative to ``root`` with ``{split}`` replaced by
    ``train_split`` / ``val_split`` (COCO 2017: ``--data.images={split}2017
    --data.annotations=annotations/instances_{split}2017.json``). ``num_classes`` is the number of categories of
    the training json, known at construction so the CLI can link it into the model.
    """

    in_chans = 3

    def __init__(
        self,
        root: str,
        images: str = "images/{split}",
        annotations: str = "annotations/instances_{split}.json",
        train_split: str = "train",
        val_split: str = "val",
        img_size: int = 1024,
        lsj_scale: tuple[float, float] | None = None,
        mean: tuple[float, float, float] = (0.485, 0.456, 0.406),
        std: tuple[float, float, float] = (0.229, 0.224, 0.225),
        size_divisibility: int = 32,
        batch_size: int = 16,
        num_workers: int | None = None,
    ) -> None:
        super().__init__()
        self.root, self.images, self.annotations = Path(root), images, annotations
        self.train_split, self.val_split = train_split, val_split
        self.img_size, self.lsj_scale, self.mean, self.std = img_size, lsj_scale, mean, std
        self.size_divisibility, self.batch_size, self.num_workers = size_divisibility, batch_size, num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    @property
    def num_classes(self) -> int:
        return len(read_categories(self._path(self.annotations, self.train_split)))

    def _path(self, pattern: str, split: str) -> Path:
        return self.root / pattern.format(split=split)

    def _dataset(self, split: str, train: bool) -> CocoDetection:
        ann = require_annotations(self._path(self.annotations, split))
        tf = detection_transform(self.img_size, train, self.lsj_scale, self.mean, self.std)
        return CocoDetection(self._path(self.images, split), ann, tf)

    def setup(self, stage: str | None = None) -> None:
        self.train_set = self._dataset(self.train_split, train=True)
        self.val_set = self._dataset(self.val_split, train=False)

    def _loader(self, ds: Dataset | None, shuffle: bool) -> DataLoader:
        assert ds is not None, "setup() not called"
        # decoded from files: workers / pinned memory per accelerator (``examples.models.loading``)
        return make_loader(
            ds, self.batch_size, shuffle, self.trainer, False, self.num_workers, _Collate(self.size_divisibility)
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)
