"""The detection example's built-in data: generated shapes written once as a COCO folder, then read like yours.

Scenes of 1-3 coloured rectangles/ellipses/triangles on noise (deterministic by seed, of varying width and
height) are saved as PNG files plus ``instances_{train,val}.json`` under a cache directory, so the default run
goes through exactly the reader, transforms and padding a user's COCO data goes through.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from examples.models.coco import CocoDetectionDataModule
from examples.models.written_data import WrittenOnce, cache_root

SHAPES = ("rectangle", "ellipse", "triangle")


def shape_mask(kind: int, cx: float, cy: float, w: float, h: float, yy: Tensor, xx: Tensor) -> Tensor:
    """Boolean mask of a rectangle (0), ellipse (1) or triangle (2) with the given box centre/size."""
    dx, dy = (xx - cx) / (w / 2), (yy - cy) / (h / 2)
    if kind == 0:
        return (dx.abs() <= 1) & (dy.abs() <= 1)
    if kind == 1:
        return dx**2 + dy**2 <= 1
    return (dy <= 1) & (dx.abs() <= (dy + 1) / 2)  # apex up, base at the bottom of the box


def make_scene(
    g: torch.Generator, height: int, width: int, min_size: int, max_size: int, max_objects: int
) -> tuple[Tensor, list[list[float]], list[int]]:
    """One uint8 (3, H, W) image with 1..max_objects shapes; boxes xywh, labels 0..2. Later shapes may occlude."""
    yy, xx = torch.meshgrid(torch.arange(height) + 0.5, torch.arange(width) + 0.5, indexing="ij")
    img = torch.rand(3, height, width, generator=g) * 0.3
    boxes, labels = [], []
    for _ in range(int(torch.randint(1, max_objects + 1, (1,), generator=g))):
        w = int(torch.randint(min_size, min(max_size, width) + 1, (1,), generator=g))
        h = int(torch.randint(min_size, min(max_size, height) + 1, (1,), generator=g))
        x0 = float(torch.randint(0, width - w + 1, (1,), generator=g))
        y0 = float(torch.randint(0, height - h + 1, (1,), generator=g))
        cls = int(torch.randint(0, len(SHAPES), (1,), generator=g))
        colour = 0.4 + 0.6 * torch.rand(3, 1, 1, generator=g)
        img = torch.where(shape_mask(cls, x0 + w / 2, y0 + h / 2, w, h, yy, xx), colour, img)
        boxes.append([x0, y0, float(w), float(h)])
        labels.append(cls)
    return (img * 255).round().to(torch.uint8), boxes, labels


def write_split(root: Path, split: str, n: int, g: torch.Generator, params: dict[str, int]) -> None:
    """``root/images/<split>/NNNNNN.png`` + ``root/annotations/instances_<split>.json``."""
    from torchvision.io import write_png

    (root / "images" / split).mkdir(parents=True)
    images, annotations = [], []
    lo = params["img_size"] * 3 // 4  # sides vary in [3/4, 1] x img_size: portrait, landscape, square
    for i in range(n):
        h, w = (int(v) for v in torch.randint(lo, params["img_size"] + 1, (2,), generator=g))
        img, boxes, labels = make_scene(g, h, w, params["min_size"], params["max_size"], params["max_objects"])
        name = f"{i:06d}.png"
        write_png(img, str(root / "images" / split / name))
        images.append({"id": i, "file_name": name, "height": h, "width": w})
        for box, label in zip(boxes, labels):
            ann = {"image_id": i, "category_id": label + 1, "bbox": box, "area": box[2] * box[3], "iscrowd": 0}
            annotations.append({"id": len(annotations) + 1, **ann})
    categories = [{"id": k + 1, "name": name} for k, name in enumerate(SHAPES)]
    data = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))


class ShapesDetectionDataModule(WrittenOnce, CocoDetectionDataModule):
    """Generated shapes in COCO format (the default): written once to ``cache_dir``, then read as COCO data.

    Pixels are normalised with mean = std = 0.5, i.e. to [-1, 1] (zero-centred inputs train ViTs markedly
    better than [0, 1]).
    """

    def __init__(
        self,
        img_size: int = 64,
        num_train: int = 2000,
        num_val: int = 256,
        min_size: int = 8,
        max_size: int = 32,
        max_objects: int = 3,
        lsj_scale: tuple[float, float] | None = None,
        size_divisibility: int = 16,
        batch_size: int = 32,
        num_workers: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        self.params = {"img_size": img_size, "min_size": min_size, "max_size": max_size, "max_objects": max_objects}
        self.splits, self.seed = {"train": num_train, "val": num_val}, seed
        super().__init__(
            str(cache_root(cache_dir, "shapes-coco", {**self.params, **self.splits, "seed": seed})),
            img_size=img_size,
            lsj_scale=lsj_scale,
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
            size_divisibility=size_divisibility,
            batch_size=batch_size,
            num_workers=num_workers,
        )

    @property
    def num_classes(self) -> int:
        return len(SHAPES)

    def _write(self, tmp: Path) -> None:
        g = torch.Generator().manual_seed(self.seed)
        for split, n in self.splits.items():
            write_split(tmp, split, n, g, self.params)
