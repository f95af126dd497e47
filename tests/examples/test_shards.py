"""Tar shards on one process, in seconds: the split rule over ranks x workers, the resumable position, the
ImageFolder -> shards command (local and ``memory://``), the digits as shards, and bad input.

Mutations seen failing: ``samples_per_rank`` "pad" as ``total // world`` (a sample never visited); the epoch left
out of the shard order's and the shuffle buffer's seeds (two epochs in one order); ``rotate`` left at 0 (a resumed
epoch's batches in another order); the decoded digits without ``Normalize`` (not DigitsDataModule's tensors).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from PIL import Image

from examples import shards as shards_cli
from examples.models.shard_data import ShardImageDataModule
from examples.models.shard_writer import read_index
from examples.models.shards import (
    ShardLoader,
    ShardStream,
    epoch_order,
    samples_per_rank,
    stream_pieces,
    worker_batches,
    worker_range,
)

pytestmark = pytest.mark.timeout(120)


class Key:
    """Decoder returning the sample's key as an int (what the tests count)."""

    def __call__(self, sample: dict[str, Any]) -> int:
        return int(sample["__key__"])


def visits(counts: list[int], world: int, workers: int, batch: int, remainder: Any) -> tuple[Counter, set[int]]:
    """Sample visits of one epoch by position, from the split rule alone; and the batches per rank."""
    order = epoch_order(len(counts), seed=3, epoch=1, shuffle=True)
    per_rank = samples_per_rank(sum(counts), world, remainder)
    seen: Counter = Counter()
    batches = set()
    for rank in range(world):
        batches.add(sum(worker_batches(per_rank, batch, workers)))
        for worker in range(workers):
            start, stop = worker_range(per_rank, batch, workers, worker)
            for p in stream_pieces(counts, order, rank * per_rank + start, rank * per_rank + stop):
                seen.update((p.shard, i) for i in range(p.start, p.stop))
    return seen, batches


@pytest.mark.parametrize("counts", [[5], [7, 3, 9], [4] * 10, [64, 64, 9]])
@pytest.mark.parametrize("world,workers,batch", [(1, 1, 4), (2, 2, 4), (3, 2, 5), (4, 3, 1), (2, 4, 64)])
def test_the_split_visits_each_sample_once_with_equal_batches(counts, world, workers, batch) -> None:
    total = sum(counts)
    if total < world:
        pytest.skip("fewer samples than ranks")
    pad, pad_batches = visits(counts, world, workers, batch, "pad")
    drop, drop_batches = visits(counts, world, workers, batch, "drop")
    assert len(pad_batches) == len(drop_batches) == 1  # every rank the same number of batches
    extra = -(-total // world) * world - total
    assert len(pad) == total and sum(pad.values()) == total + extra  # pad: all, the first `extra` of the epoch twice
    order = epoch_order(len(counts), seed=3, epoch=1, shuffle=True)
    stream = [(s, i) for s in order for i in range(counts[s])]
    assert sorted(k for k, n in pad.items() if n == 2) == sorted(stream[:extra])
    assert set(drop) == set(stream[: total - total % world]) and set(drop.values()) == {1}  # drop: the last N mod R


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder tree: 3 classes x 7 (train) / 2 (val) RGB images, PNG and JPEG."""
    root = tmp_path_factory.mktemp("imagefolder")
    rng = np.random.default_rng(0)
    for split, n in (("train", 7), ("val", 2)):
        for c in ("cat", "dog", "eel"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                image = Image.fromarray(rng.integers(0, 255, (6, 5, 3), dtype=np.uint8))
                image.save(root / split / c / f"{i}.{'png' if i % 2 else 'jpeg'}")
    return root


@pytest.mark.parametrize("dest", ["local", "memory://shards"])
def test_imagefolder_to_shards_round_trips(folder: Path, tmp_path: Path, dest: str, capsys) -> None:
    dest = str(tmp_path / "shards") if dest == "local" else dest
    assert shards_cli.main(["write-shards", str(folder), dest, "--samples-per-shard", "4"]) == 0
    assert "train: 21 samples, val: 6 samples" in capsys.readouterr().out
    index = read_index(dest)
    assert index.classes == ["cat", "dog", "eel"] and index.channels == 3
    urls, counts = index.split("train")
    assert counts == [4, 4, 4, 4, 4, 1]
    files = [(p.read_bytes(), label) for label, c in enumerate(index.classes)
             for p in sorted((folder / "train" / c).iterdir())]  # fmt: skip
    loader = ShardLoader(ShardStream(urls, counts, lambda s: s, rank=0, world=1, batch_size=1, workers=1,
                                     shuffle=False), num_workers=0, collate_fn=lambda b: b[0])  # fmt: skip
    read = [(s.get("png", s.get("jpg")), int(s["cls"])) for s in loader]
    assert read == files  # the files' own bytes, their labels, in order
    with fsspec.open(f"{dest}/index.json") as f:
        written = json.load(f)
    fsspec.filesystem("memory" if dest.startswith("memory") else "file").rm(f"{dest}/index.json")
    assert shards_cli.main(["index", dest]) == 0  # the index of shards written elsewhere: the same counts
    with fsspec.open(f"{dest}/index.json") as f:
        assert json.load(f)["splits"] == written["splits"]


def small_stream(tmp_path: Path, **kw: Any) -> tuple[list[str], list[int]]:
    """5 shards of 13 samples (keys 0..64) written by the command, read back through a ``file://`` URL."""
    src = tmp_path / "src"
    for i in range(65):
        (src / "train" / str(i % 3)).mkdir(parents=True, exist_ok=True)
        Image.new("L", (2, 2), i).save(src / "train" / str(i % 3) / f"{i:02d}.png")
    shards_cli.main(["write-shards", str(src), str(tmp_path / "out"), "--samples-per-shard", "13"])
    return read_index(f"file://{tmp_path}/out").split("train")


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_the_same_batches_and_epochs_differ(tmp_path: Path, workers: int) -> None:
    urls, counts = small_stream(tmp_path)

    def loader() -> ShardLoader:
        stream = ShardStream(urls, counts, Key(), rank=1, world=2, batch_size=4, workers=max(1, workers),
                             shuffle=True, shuffle_buffer=8, seed=0)  # fmt: skip
        return ShardLoader(stream, num_workers=workers, epoch=lambda: 1)

    full = [b.tolist() for b in loader()]
    assert len(full) == len(loader()) == 9  # ceil(ceil(65 / 2) / 4)
    for stop in (1, 4, 8):
        first = loader()
        it = iter(first)
        taken = [next(it).tolist() for _ in range(stop)]
        state = first.state_dict()
        assert state["samples"] == sum(map(len, taken)) and state["batches"] == stop
        resumed = loader()
        resumed.load_state_dict(state)
        assert taken + [b.tolist() for b in resumed] == full
    other = ShardLoader(ShardStream(urls, counts, Key(), rank=1, world=2, batch_size=4, workers=1, shuffle=True,
                                    shuffle_buffer=8, seed=0), num_workers=0, epoch=lambda: 2)  # fmt: skip
    assert [b.tolist() for b in other] != full  # another epoch, another order


def test_an_end_of_epoch_position_resumes_under_any_layout_a_mid_epoch_one_only_under_its_own(tmp_path: Path):
    """Issue 49: the layout was compared before the epoch's end was looked at, so an end-of-epoch checkpoint
    refused another number of ranks, workers or batch size (mutation: the two checks swapped back)."""
    urls, counts = small_stream(tmp_path)

    def make(world: int = 2, workers: int = 1, batch: int = 4) -> ShardLoader:
        stream = ShardStream(urls, counts, Key(), rank=0, world=world, batch_size=batch, workers=workers,
                             shuffle=True, shuffle_buffer=8, seed=0)  # fmt: skip
        return ShardLoader(stream, num_workers=workers, epoch=lambda: 1)

    def position(loader: ShardLoader, batches: int) -> dict[str, Any]:
        it = iter(loader)
        for _ in range(batches):
            next(it)
        return loader.state_dict()

    ended, middle = position(make(), len(make())), position(make(), 3)
    assert ended["batches"] == ended["epoch_batches"] == 9 and ended["samples"] == 33
    for layout in ({"world": 1}, {"workers": 2}, {"batch": 5}, {"world": 3, "workers": 2, "batch": 2}):
        fresh = [b.tolist() for b in make(**layout)]
        resumed = make(**layout)
        resumed.load_state_dict(ended)  # the next epoch starts from its beginning, as a fresh loader's
        assert [b.tolist() for b in resumed] == fresh
        with pytest.raises(ValueError, match="mid-epoch.*--trainer.devices, --data.num_workers, --data.batch_size"):
            make(**layout).load_state_dict(middle)


def write_tar(path: Path, samples: int) -> None:
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            for ext, data in (("png", bytes(300)), ("cls", b"1")):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("damage", ["cut-in-data", "cut-in-header", "short", "garbage"])
def test_a_damaged_shard_fails_naming_it_and_what_to_do(tmp_path: Path, damage: str) -> None:
    """Issue 49: a truncated tar surfaced as WebDataset's raw tuple, and a shard shorter than its index entry
    advised re-indexing, which trains on without the lost samples."""
    shard = tmp_path / "train-000000.tar"
    write_tar(shard, 8)
    data = shard.read_bytes()
    if damage.startswith("cut"):  # each sample 2 members of 1024 bytes: inside the 6th's image, or its header
        shard.write_bytes(data[: 5 * 2048 + (600 if damage == "cut-in-data" else 100)])
    elif damage == "short":  # a valid tar of fewer samples
        write_tar(shard, 5)
    else:
        shard.write_bytes(data[:512] + bytes(range(256)) * 4 + data[1536:])
    stream = ShardStream([str(shard)], [8], lambda s: s["__key__"], rank=0, world=1, batch_size=2, workers=1,
                         shuffle=False)  # fmt: skip
    with pytest.raises(OSError, match="Shard .*train-000000.tar is damaged") as error:
        list(ShardLoader(stream, num_workers=0))
    message = str(error.value)
    assert "Restore it" in message and "re-indexing alone would train without the lost samples" in message
    # tarfile ends a stream at a cut or garbled header silently: the count the index records tells
    assert ("not a readable tar" if damage == "cut-in-data" else "index.json records at least 8") in message


def test_bad_input_fails_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="write-shards SRC DEST"):
        ShardStream([], [], Key(), rank=0, world=1, batch_size=1, workers=1, shuffle=False)
    for url in (f"file://{tmp_path}/nowhere", "memory://nowhere"):
        with pytest.raises(FileNotFoundError, match=r"is the path or URL right\?.*python -m examples.shards index"):
            ShardImageDataModule(root=url)
    with pytest.raises(FileNotFoundError, match="SRC/train/<class>"):
        shards_cli.main(["write-shards", str(tmp_path), str(tmp_path / "out")])
    with pytest.raises(ValueError, match="remainder='x'"):
        samples_per_rank(10, 2, "x")  # type: ignore[arg-type]


def test_fewer_shards_than_ranks_times_workers_still_splits_exactly(tmp_path: Path) -> None:
    """One shard for 2 ranks x 2 workers: each reads its part of it (the later parts skip the earlier)."""
    urls, counts = small_stream(tmp_path)
    seen: Counter = Counter()
    for rank in range(2):
        stream = ShardStream(urls[:1], counts[:1], Key(), rank=rank, world=2, batch_size=2, workers=2, shuffle=False)
        seen.update(k for b in ShardLoader(stream, num_workers=2) for k in b.tolist())
    assert seen == Counter({**dict.fromkeys(range(13), 1), 0: 2})  # 13 over 2 ranks: key 0 padded


def test_digits_as_shards_decode_to_digits_tensors(tmp_path: Path) -> None:
    from examples.models.datamodules import DigitsDataModule

    data = ShardImageDataModule(cache_dir=str(tmp_path), batch_size=400)
    data.prepare_data()
    data.setup()
    x, y = next(iter(data.val_dataloader()))
    reference = DigitsDataModule()
    reference.setup()
    assert reference.val_set is not None
    xr, yr = reference.val_set.tensors  # type: ignore[attr-defined]
    assert len(y) == len(yr) == 360
    assert torch.equal(y, yr) and torch.allclose(x, xr, atol=1e-6)  # same split, order and pixels
