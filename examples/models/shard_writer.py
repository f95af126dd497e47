"""Writing tar shards (WebDataset format) and their index: from an ImageFolder tree, from the digits, or an index
for shards written elsewhere.

A folder (local or any fsspec URL) of shards reads as ``ROOT/{split}-000000.tar ...`` plus ``ROOT/index.json``:
``{"classes": [...], "channels": 1 | 3, "splits": {"train": {"shards": [names], "samples": [counts]}, ...}}``.
The per-shard sample counts let every rank know, before reading a byte of image, how many batches the epoch has
(equal steps on every rank). Each sample is ``<key>.<png|jpg|...>`` (the file's bytes as they were: no re-encoding)
and ``<key>.cls`` (the class index as text), keys numbered in the source's sorted order.
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from webdataset import TarWriter
from webdataset.tariterators import group_by_keys, tar_file_expander

INDEX = "index.json"
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "bmp", "ppm")
SPLITS = ("train", "val")


@dataclass(frozen=True)
class ShardIndex:
    """What ``index.json`` says, with the shard names turned into URLs under the root."""

    root: str
    classes: list[str]
    channels: int
    splits: dict[str, tuple[list[str], list[int]]]

    def split(self, name: str) -> tuple[list[str], list[int]]:
        if name not in self.splits or not self.splits[name][0]:
            raise ValueError(
                f"{self.root}/{INDEX} lists no {name!r} shards; write them with "
                f"`python -m examples.shards write-shards SRC {self.root}` (SRC/{name}/<class>/*)"
            )
        return self.splits[name]


def label(sample: dict[str, Any]) -> int:
    """The sample's class index (its ``<key>.cls`` file); a sample without one fails naming the layout."""
    if "cls" not in sample:
        raise ValueError(f"sample {sample['__key__']} of {sample['__url__']} has no <key>.cls file (the class index)")
    return int(sample["cls"])


def read_index(root: str) -> ShardIndex:
    """Read ``root/index.json`` (a local folder or an fsspec URL); a missing one fails naming the two fixes."""
    root = root.rstrip("/")
    try:
        with fsspec.open(f"{root}/{INDEX}", "r") as file:
            raw = json.load(file)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"no {INDEX} under {root!r}: is the path or URL right? Shards written by "
            "`python -m examples.shards write-shards SRC DEST` have one; for shards written elsewhere "
            f"(ROOT/{{train,val}}-*.tar), write it with `python -m examples.shards index {root}`"
        ) from err
    splits = {s: ([f"{root}/{n}" for n in v["shards"]], list(v["samples"])) for s, v in raw["splits"].items()}
    return ShardIndex(root, list(raw["classes"]), int(raw["channels"]), splits)


def write_split(samples: Iterable[tuple[bytes, str, int]], dest: str, split: str, per_shard: int) -> dict[str, list]:
    """Write ``(image bytes, extension, label)`` samples as ``dest/{split}-NNNNNN.tar``; returns the index entry."""
    if per_shard < 1:
        raise ValueError(f"--samples-per-shard={per_shard} must be >= 1")
    names: list[str] = []
    counts: list[int] = []
    writer: TarWriter | None = None
    stream: Any = None
    for key, (data, ext, label) in enumerate(samples):
        if key % per_shard == 0:
            if writer is not None:
                writer.close()
                stream.close()
            names.append(f"{split}-{len(names):06d}.tar")
            counts.append(0)
            stream = fsspec.open(f"{dest}/{names[-1]}", "wb").open()
            writer = TarWriter(stream)
        assert writer is not None
        writer.write({"__key__": f"{key:08d}", ext: data, "cls": str(label).encode()})
        counts[-1] += 1
    if writer is not None:
        writer.close()
        stream.close()
    return {"shards": names, "samples": counts}


def write_index(dest: str, classes: list[str], channels: int, splits: dict[str, dict[str, list]]) -> None:
    with fsspec.open(f"{dest}/{INDEX}", "w") as file:
        json.dump({"classes": classes, "channels": channels, "splits": splits}, file, indent=1)


def imagefolder_samples(split_dir: Path, class_to_idx: dict[str, int]) -> Iterator[tuple[bytes, str, int]]:
    """Every image of ``split_dir/<class>/*`` in sorted order, as its file's bytes."""
    for name, label in sorted(class_to_idx.items()):
        for path in sorted((split_dir / name).rglob("*")):
            ext = path.suffix.lower().lstrip(".")
            if path.is_file() and ext in IMAGE_EXTS:
                yield path.read_bytes(), "jpg" if ext == "jpeg" else ext, label


def write_imagefolder(src: str, dest: str, per_shard: int) -> dict[str, int]:
    """ImageFolder ``src/{train,val}/<class>/*`` -> shards + index at ``dest``; returns samples per split."""
    from torchvision.datasets.folder import find_classes

    root = Path(src)
    splits = [s for s in SPLITS if (root / s).is_dir()]
    if not splits:
        raise FileNotFoundError(f"{src} has neither train/ nor val/: expected SRC/train/<class>/*.jpg (ImageFolder)")
    classes, class_to_idx = find_classes(str(root / splits[0]))
    fs, path = fsspec.core.url_to_fs(dest)
    fs.makedirs(path, exist_ok=True)
    index = {s: write_split(imagefolder_samples(root / s, class_to_idx), dest, s, per_shard) for s in splits}
    for split, entry in index.items():
        if not entry["shards"]:
            raise ValueError(f"{root / split} holds no image ({', '.join(IMAGE_EXTS)}) in its class folders")
    write_index(dest, classes, 3, index)  # read like torchvision's ImageFolder: converted to RGB
    return {s: sum(v["samples"]) for s, v in index.items()}


def write_digits(dest: Path, seed: int = 0) -> None:
    """scikit-learn's digits as grey 8x8 PNGs, the 80/20 stratified split of ``DigitsDataModule`` (same seed).

    Pixel values 0..16 are stored as ``15 * v`` (0..240): exact, so decoding gives ``DigitsDataModule``'s tensors.
    """
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    tr, va = train_test_split(range(len(y)), test_size=0.2, stratify=y, random_state=seed)

    def png(i: int) -> tuple[bytes, str, int]:
        buffer = io.BytesIO()
        Image.fromarray((x[i].reshape(8, 8) * 15).astype(np.uint8), mode="L").save(buffer, format="PNG")
        return buffer.getvalue(), "png", int(y[i])

    dest.mkdir(parents=True)
    index = {s: write_split(map(png, ids), str(dest), s, 256) for s, ids in (("train", tr), ("val", va))}
    write_index(str(dest), [str(c) for c in range(10)], 1, index)


def index_shards(root: str) -> dict[str, int]:
    """Count the samples of existing ``root/{train,val}-*.tar`` and write ``root/index.json`` (one full read)."""
    fs, path = fsspec.core.url_to_fs(root)
    splits: dict[str, dict[str, list]] = {}
    labels: set[int] = set()
    for split in SPLITS:
        names = sorted(posixpath.basename(p) for p in fs.glob(f"{path}/{split}-*.tar"))
        counts = []
        for name in names:
            counts.append(0)
            with fs.open(f"{path}/{name}", "rb") as stream:
                for sample in group_by_keys(tar_file_expander([{"url": name, "stream": stream}])):
                    labels.add(label(sample))
                    counts[-1] += 1
        if names:
            splits[split] = {"shards": names, "samples": counts}
    if not splits:
        raise FileNotFoundError(f"no {{train,val}}-*.tar under {root!r}: name the shards <split>-<n>.tar")
    classes = [str(c) for c in range(max(labels, default=-1) + 1)]
    write_index(root.rstrip("/"), classes, 3, splits)  # decoded as RGB, as torchvision's ImageFolder does
    return {s: sum(v["samples"]) for s, v in splits.items()}
