"""Rank script for VitScaleStrategy(async_save=True): a sync run as the oracle, a held-back background write, and a
failing one; facts per rank in ``<out>/async-rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from lightning_vitscale import AsyncSaveError, VitScaleStrategy
from tests.helpers.models import Classifier, loader

warnings.filterwarnings("ignore")
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
HOLD_S = 30.0  # a synchronous save waits this long for a release that never comes, then the test fails
_write_data = _FileSystemWriter.write_data


class HeldWrite:
    """On rank 1, the shard write of the save at step 2 waits (in the writing thread) until released."""

    def __init__(self) -> None:
        self.release, self.saw_release, self.calls, self.thread = threading.Event(), None, 0, None

    def __call__(self, writer, plan, planner):
        self.calls += 1
        if RANK == 1 and self.calls == 1:
            self.thread = threading.current_thread().name
            self.saw_release = self.release.wait(HOLD_S)
        return _write_data(writer, plan, planner)


class FailingWrite:
    """On rank 1, the shard write of the second save raises, as a full disk would."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, writer, plan, planner):
        self.calls += 1
        if RANK == 1 and self.calls == 2:
            raise OSError(28, "No space left on device (injected)")
        return _write_data(writer, plan, planner)


def as_method(write):
    def write_data(writer, plan, planner):
        return write(writer, plan, planner)

    return write_data


class Release(L.Callback):
    """At the end of step 3 (the parameters already updated past the save of step 2): note what is committed,
    then release rank 1's held write."""

    def __init__(self, held: HeldWrite, folder: Path) -> None:
        self.held, self.folder, self.committed_while_held = held, folder, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3 and RANK == 1:
            self.committed_while_held = (self.folder / "step=2.ckpt").exists()
            self.held.release.set()


class WaitForFailure(L.Callback):
    """Test harness only: before the strategy's hook of step 5, wait until the failed save finished on this rank,
    so the step that must report it is known."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            in_flight = trainer.strategy.checkpoints.saves._in_flight
            deadline = time.monotonic() + HOLD_S
            while in_flight is not None and not in_flight.done() and time.monotonic() < deadline:
                time.sleep(0.01)


def fit(folder: Path, async_save: bool, callbacks: list, steps: int = 6, **checkpoint) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    options = dict(every_n_train_steps=2, save_top_k=-1, filename="{step}", save_last=True) | checkpoint
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=VitScaleStrategy(async_save=async_save), max_steps=steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=folder, **options)],
    )
    trainer.fit(Classifier("encoder"), loader(n=64))
    return trainer


def held_write(out: Path) -> dict:
    held = HeldWrite()
    release = Release(held, out / "async")
    _FileSystemWriter.write_data = as_method(held)
    try:
        trainer = fit(out / "async", True, [release], save_last=False)  # one save per step: none waits on another
    finally:
        _FileSystemWriter.write_data = _write_data
    return {
        "saw_release": held.saw_release,
        "writer_thread": held.thread,
        "committed_while_held": release.committed_while_held,
        "global_step": trainer.global_step,
    }


def failing_write(out: Path) -> dict:
    _FileSystemWriter.write_data = as_method(FailingWrite())
    steps_seen: list[int] = []
    step_of = L.Callback()
    step_of.on_exception = lambda trainer, *args: steps_seen.append(trainer.global_step)  # optimizer steps done
    try:
        fit(out / "fail", True, [WaitForFailure(), step_of], steps=8, save_top_k=0)
    except AsyncSaveError as error:
        return {"error": str(error), "raised_at_step": steps_seen[-1]}
    finally:
        _FileSystemWriter.write_data = _write_data
    return {"error": None}


def main() -> None:
    out = Path(sys.argv[1])
    fit(out / "sync", False, [])
    facts = {"held": held_write(out), "failing": failing_write(out)}
    (out / f"async-rank{RANK}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
