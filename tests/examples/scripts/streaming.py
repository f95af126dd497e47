"""Rank script: the tar-shard datamodules under ``Trainer.fit`` on 2 ranks x 2 loader workers, in one launch.

``streaming.py OUT_DIR WORK_DIR name1,name2``; WORK_DIR holds the digits written once as shards and the runs.
* ``epoch-resume``: one epoch of the streamed digits (vitscale, 2 loader workers per rank), each rank recording
  the sample keys of its batches, checkpointed after step ``SAVE_AT``; then a run resumed from that checkpoint.
* ``end-resume`` (after ``epoch-resume``, on 2 ranks or 1): the next epoch from its end-of-epoch checkpoint with
  another number of loader workers and batch size (and, on 1 rank, of ranks), recording its batches' keys.
* ``mid-refused`` (after ``epoch-resume``): the mid-epoch checkpoint under that other layout: the error's text.
* ``cli-classification``, ``cli-pretraining``: the examples' own CLIs (``fast_dev_run``; no loader worker: the
  workers are tested above), ``--data=ShardImageDataModule --data.root=file://...`` and
  ``--data=ShardMultiCropDataModule`` on the built-in digits shards.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from examples import classification, pretraining
from examples.classification import ViTClassifier
from examples.models.shard_data import ShardImageDataModule
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
WORK = sys.argv.pop(2)  # run_scenarios reads argv[1] (out dir) and argv[2] (names)
BATCH, WORKERS, SAVE_AT, OTHER_BATCH = 64, 2, 5, 128
DEVICES = int(os.environ.get("WORLD_SIZE", "2"))


class WithKey:
    """The datamodule's decoder, plus the sample's key (its index in the split) as a third batch entry."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, int, int]:
        return (*self.decode(sample), int(sample["__key__"]))


class KeyedShards(ShardImageDataModule):
    def decoder(self, train: bool) -> Any:
        return WithKey(super().decoder(train))


class KeyedClassifier(ViTClassifier):
    """The classification example's model, recording the keys of every training batch it steps on."""

    def __init__(self) -> None:
        super().__init__(size="tiny")
        self.keys: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, keys = batch
        self.keys.append(keys.tolist())
        return super().training_step((x, y), batch_idx)


class Saved(pl.Callback):
    """The stream position as each checkpoint stores it (in the datamodule's state)."""

    def __init__(self) -> None:
        self.saved: list[Any] = []

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.saved.append(checkpoint[KeyedShards.__qualname__]["train_stream"])


def fit(
    model: KeyedClassifier, callbacks: list[pl.Callback], ckpt_path: str | None = None, epochs: int = 1,
    batch: int = BATCH, workers: int = WORKERS,
) -> tuple[KeyedClassifier, pl.Trainer]:
    trainer = pl.Trainer(
        accelerator="cpu", devices=DEVICES, strategy="vitscale", max_epochs=epochs, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=WORK,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )  # fmt: skip
    data = KeyedShards(batch_size=batch, num_workers=workers, shuffle_buffer=200, cache_dir=f"{WORK}/cache")
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, trainer


def epoch_and_resume() -> dict:
    """One epoch, checkpointed after step SAVE_AT; then a run resumed from that checkpoint (as after a kill: it
    knows nothing of what the first run did after the checkpoint)."""
    ckpt = ModelCheckpoint(dirpath=f"{WORK}/ckpt", filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1)
    end = ModelCheckpoint(dirpath=f"{WORK}/end", filename="end", save_on_train_epoch_end=True)
    saved = Saved()
    first, trainer = fit(KeyedClassifier(), [ckpt, end, saved])
    resumed, _ = fit(KeyedClassifier(), [], ckpt_path=f"{WORK}/ckpt/step={SAVE_AT}.ckpt")
    return {"epoch": first.keys, "len": trainer.num_training_batches, "resumed": resumed.keys, "saved": saved.saved}


def end_resume() -> dict:
    """Epoch 1 from the end-of-epoch checkpoint, with 1 loader worker and another batch size."""
    model, trainer = fit(KeyedClassifier(), [], f"{WORK}/end/end.ckpt", epochs=2, batch=OTHER_BATCH, workers=1)
    return {"epoch": model.keys, "len": trainer.num_training_batches, "step": trainer.global_step}


def mid_refused() -> dict:
    """The mid-epoch checkpoint under the other layout: refused, naming the flags."""
    try:
        fit(KeyedClassifier(), [], f"{WORK}/ckpt/step={SAVE_AT}.ckpt", batch=OTHER_BATCH, workers=1)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def cli(module: Any, data: str, at_url: bool) -> dict:
    """The example's CLI on the shards: at a ``file://`` URL (``--data.root``) or the built-in digits (no root)."""
    args = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.fast_dev_run=1", f"--data={data}",
            "--data.num_workers=0", f"--trainer.default_root_dir={WORK}", f"--data.cache_dir={WORK}/cache"]  # fmt: skip
    if at_url:
        args += [f"--data.root=file://{WORK}/cache/{_digits_folder()}", "--data.img_size=16"]
    run = module.main(args, run=False)
    run.trainer.fit(run.model, run.datamodule)
    return {"steps": run.trainer.global_step, "in_chans": run.model.hparams["in_chans"], "root": run.datamodule.root}


def _digits_folder() -> str:
    return ShardImageDataModule(cache_dir=f"{WORK}/cache").root.rsplit("/", 1)[1]


def timed(scenario: Callable[[], dict]) -> Callable[[], dict]:
    def run() -> dict:
        start = time.monotonic()
        return {**scenario(), "seconds": time.monotonic() - start}

    return run


if __name__ == "__main__":
    run_scenarios({
        "epoch-resume": timed(epoch_and_resume),
        "end-resume": timed(end_resume),
        "mid-refused": timed(mid_refused),
        "cli-classification": timed(lambda: cli(classification, "ShardImageDataModule", at_url=True)),
        "cli-pretraining": timed(lambda: cli(pretraining, "ShardMultiCropDataModule", at_url=False)),
    })  # fmt: skip
