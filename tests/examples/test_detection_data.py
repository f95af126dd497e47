"""COCO-format detection data: the generated default written as a COCO folder and read back, a hand-made user folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchvision.io import decode_image, write_jpeg, write_png

from examples.models.coco import CocoDetectionDataModule, pad_collate
from examples.models.shapes_coco import ShapesDetectionDataModule

pytestmark = pytest.mark.timeout(120)


def test_default_is_written_as_coco_and_read_back_through_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dm = ShapesDetectionDataModule(
        img_size=64, num_train=6, num_val=4, cache_dir=str(tmp_path), batch_size=4, num_workers=0
    )
    dm.prepare_data()
    root = dm.root
    assert sorted(p.name for p in (root / "images" / "val").iterdir()) == [f"{i:06d}.png" for i in range(4)]
    data = json.loads((root / "annotations" / "instances_val.json").read_text())
    assert [c["name"] for c in data["categories"]] == ["rectangle", "ellipse", "triangle"]
    sizes = {(im["height"], im["width"]) for im in data["images"]}
    assert len(sizes) > 1, "generated images should vary in size"
    monkeypatch.setattr("examples.models.shapes_coco.write_split", lambda *a: pytest.fail("written twice"))
    dm.prepare_data()  # e.g. the next run, or another rank: the folder is there, nothing is generated again
    dm.setup()
    assert dm.num_classes == 3 and len(dm.train_set) == 6  # type: ignore[arg-type]
    # val: longer side resized to img_size; boxes are the json's xywh, converted and scaled the same way
    im = data["images"][0]
    img, target = dm.val_set[0]  # type: ignore[index]
    scale = 64 / max(im["height"], im["width"])
    assert max(img.shape[1:]) == 64 and abs(min(img.shape[1:]) - min(im["height"], im["width"]) * scale) <= 1
    sy, sx = img.shape[1] / im["height"], img.shape[2] / im["width"]
    expected = torch.tensor([a["bbox"] for a in data["annotations"] if a["image_id"] == im["id"]])
    expected = torch.cat([expected[:, :2], expected[:, :2] + expected[:, 2:]], 1) * torch.tensor([sx, sy, sx, sy])
    torch.testing.assert_close(target["boxes"], expected, atol=0.6, rtol=0)
    raw = decode_image(str(root / "images" / "val" / im["file_name"])).float() / 255
    assert img.min() >= -1 and img.max() <= 1 and abs(img.mean() - (raw.mean() * 2 - 1)) < 0.05  # mean=std=0.5
    x, targets = next(iter(dm.val_dataloader()))
    assert x.shape[0] == 4 and x.shape[-1] % 16 == 0 and x.shape[-2] % 16 == 0 and len(targets) == 4


def _user_folder(root: Path) -> None:
    """Two JPEG/PNG images of different sizes; category ids 3 and 7; one crowd box; one image without boxes."""
    (root / "images" / "train").mkdir(parents=True)
    (root / "annotations").mkdir()
    write_jpeg(torch.full((3, 40, 60), 200, dtype=torch.uint8), str(root / "images" / "train" / "a.jpg"))
    write_png(torch.zeros(3, 50, 30, dtype=torch.uint8), str(root / "images" / "train" / "b.png"))
    write_png(torch.zeros(3, 20, 20, dtype=torch.uint8), str(root / "images" / "train" / "c.png"))
    data = {
        "images": [
            {"id": 10, "file_name": "a.jpg", "height": 40, "width": 60},
            {"id": 11, "file_name": "b.png", "height": 50, "width": 30},
            {"id": 12, "file_name": "c.png", "height": 20, "width": 20},
        ],
        "annotations": [
            {"id": 1, "image_id": 10, "category_id": 7, "bbox": [6, 4, 30, 20], "iscrowd": 0},
            {"id": 2, "image_id": 10, "category_id": 3, "bbox": [0, 0, 60, 40], "iscrowd": 1},
            {"id": 3, "image_id": 11, "category_id": 3, "bbox": [3, 5, 9, 15], "iscrowd": 0},
        ],
        "categories": [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}],
    }
    for split in ("train", "val"):
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
    (root / "images" / "val").symlink_to(root / "images" / "train")


def test_user_coco_folder(tmp_path: Path) -> None:
    _user_folder(tmp_path)
    dm = CocoDetectionDataModule(str(tmp_path), img_size=120, size_divisibility=32, batch_size=3, num_workers=0)
    assert dm.num_classes == 2
    dm.setup()
    x, targets = next(iter(dm.val_dataloader()))
    # a: 40x60 -> 80x120; b: 50x30 -> 120x72; c: 20x20 -> 120x120; padded to 128x128 (multiple of 32)
    assert x.shape == (3, 3, 128, 128)
    assert x[1, :, :, 72:].abs().max() == 0 and x[0, :, 80:].abs().max() == 0, "padding is zero"
    torch.testing.assert_close(targets[0]["boxes"], torch.tensor([[12.0, 8.0, 72.0, 48.0]]))  # crowd box dropped
    assert targets[0]["labels"].tolist() == [1]  # id 7 is the second category by id
    torch.testing.assert_close(targets[1]["boxes"], torch.tensor([[7.2, 12.0, 28.8, 48.0]]))  # xywh 3,5,9,15 x 2.4
    assert targets[1]["labels"].tolist() == [0]
    assert targets[2]["boxes"].shape == (0, 4)


def test_large_scale_jitter_gives_fixed_size_crops_with_boxes_inside(tmp_path: Path) -> None:
    _user_folder(tmp_path)
    dm = CocoDetectionDataModule(str(tmp_path), img_size=64, lsj_scale=(0.5, 2.0), batch_size=3, num_workers=0)
    dm.setup()
    torch.manual_seed(0)
    for _ in range(5):
        x, targets = next(iter(dm.train_dataloader()))
        assert x.shape == (3, 3, 64, 64)
        for t in targets:
            b = t["boxes"]
            assert ((b >= 0) & (b <= 64)).all() and (b[:, 2:] > b[:, :2]).all()


def test_missing_coco_files_name_the_layout(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"images/<split>/ and ROOT/annotations/instances_<split>.json"):
        _ = CocoDetectionDataModule(str(tmp_path)).num_classes


def test_pad_collate_rounds_up_to_the_divisor() -> None:
    batch = [(torch.ones(3, 33, 20), {}), (torch.ones(3, 10, 47), {})]
    x, _ = pad_collate(batch, 16)  # type: ignore[arg-type]
    assert x.shape == (2, 3, 48, 48) and x[0, :, 33:].sum() == 0 and x[1, :, :, 47:].sum() == 0
