"""Throughput of the classification example reading tar shards against reading the same images from a folder.

Usage::

    python benchmarks/stream_vs_folder.py                 # 3 rounds each, interleaved; prints a Markdown table
    python benchmarks/stream_vs_folder.py --rounds 5 --workers 2 --img-size 32

Data: scikit-learn's 1797 digits written once as RGB PNGs (``--img-size`` px, nearest upsampling) in an ImageFolder
tree, then ``python -m examples.shards write-shards`` of that tree (256 samples per shard). Each run is one epoch
of ``Trainer.fit`` (1 process, CPU, the example's ``ViTClassifier`` tiny, no validation) with
``FolderImageDataModule`` or ``ShardImageDataModule`` on it: the same decoding (PIL), the same transforms, the same
loader workers; only the reading differs. The runs alternate (folder, stream, stream, folder, ...) so a machine
shared with other jobs loads both sides alike. Reported per side: median samples/s over the rounds (the epoch's
wall time from its first batch start to its end), the ``DataWaitTimer`` share (time waiting for batches / step
time + wait), and the stream/folder ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_folder(root: Path, img_size: int) -> None:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    for i, (pixels, label) in enumerate(zip(x, y, strict=True)):
        split = "val" if i % 5 == 0 else "train"
        image = Image.fromarray((pixels.reshape(8, 8) * 15).astype(np.uint8)).convert("RGB")
        (root / split / str(label)).mkdir(parents=True, exist_ok=True)
        image.resize((img_size, img_size), Image.NEAREST).save(root / split / str(label) / f"{i:04d}.png")


def one_epoch(data: Any, img_size: int) -> dict[str, float]:
    import lightning.pytorch as pl

    from examples.classification import ViTClassifier
    from examples.models.loading import DataWaitTimer

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.start = getattr(self, "start", None) or time.perf_counter()

        def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.seconds = time.perf_counter() - self.start

    timer, clock = DataWaitTimer(), Clock()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[timer, clock],
    )  # fmt: skip
    model = ViTClassifier(size="tiny", num_classes=10, in_chans=3, img_size=img_size)
    trainer.fit(model, data)
    samples = trainer.num_training_batches * data.batch_size  # the last batch may be short: same on both sides
    wait, step = timer._wait, timer._step
    return {"samples_per_s": samples / clock.seconds, "wait_share": wait / (wait + step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    from examples import shards
    from examples.models.datamodules import FolderImageDataModule
    from examples.models.shard_data import ShardImageDataModule

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder, tars = Path(tmp) / "folder", Path(tmp) / "shards"
        write_folder(folder, args.img_size)
        shards.main(["write-shards", str(folder), str(tars), "--samples-per-shard", "256"])
        common = {"img_size": args.img_size, "batch_size": args.batch_size, "num_workers": args.workers}
        sides = {
            "folder": lambda: FolderImageDataModule(str(folder), **common),
            "stream": lambda: ShardImageDataModule(str(tars), shuffle_buffer=1000, **common),
        }
        results: dict[str, list[dict[str, float]]] = {"folder": [], "stream": []}
        for r in range(args.rounds):
            for side in ("folder", "stream") if r % 2 == 0 else ("stream", "folder"):
                results[side].append(one_epoch(sides[side](), args.img_size))
                print(side, {k: round(v, 3) for k, v in results[side][-1].items()}, flush=True)
    med = {s: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for s, rows in results.items()}
    print(f"\n{args.rounds} rounds, {args.workers} loader worker(s), {args.img_size} px, batch {args.batch_size}\n")
    print("| reading | samples/s (median) | data-wait share | vs folder |\n| --- | --- | --- | --- |")
    for side, m in med.items():
        ratio = m["samples_per_s"] / med["folder"]["samples_per_s"]
        print(f"| {side} | {m['samples_per_s']:.0f} | {100 * m['wait_share']:.0f}% | {ratio:.3f} |")
    pairs = zip(results["stream"], results["folder"], strict=True)
    ratios = [s["samples_per_s"] / f["samples_per_s"] for s, f in pairs]
    print(f"\nstream/folder per round: {', '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
