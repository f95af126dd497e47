"""Rank script for the fault-injection suite (``tests/distributed/test_fault_injection.py``).

``kill <scenario> <out>``: ``Trainer.fit`` on 2 ranks with ``ModelCheckpoint(every_n_train_steps=2,
save_last=True)`` until one rank SIGKILLs itself at the scenario's point: after writing part of its shard of one
save (synchronous, or in the background thread of an asynchronous one), or between two steps. Every save's
gathered weights and optimizer state are recorded as it starts (``<out>/<scenario>/saved/step<N>.pt``).

``resume <out> <devices>``: on 2 ranks or 1, resume every scenario's folder with ``fit(ckpt_path="last")`` and
with ``auto_resume=True``, recording the restored state and the log lines; then damage the newest checkpoint
(a flipped byte, a truncated shard) and resume again; then ask for the damaged folder explicitly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.checkpoint import CheckpointError
from tests.helpers.models import Classifier, loader
from tests.helpers.state import snapshot

RANK = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
ITEMS_BEFORE_KILL = 3  # tensors of its shard a dying rank writes (and flushes) before SIGKILL


@dataclass(frozen=True)
class Kill:
    """Where a rank dies: ``rank`` SIGKILLs itself at the save of ``step`` to ``target`` (after writing part of
    its shard), or, with ``target=None``, as step ``step`` begins."""

    rank: int
    step: int
    target: str | None
    async_save: bool = False


SCENARIOS = {  # three launches: each point once, rank 0 (the committer, and Lightning's launching rank) once
    "sync-r0": Kill(0, 6, "last.ckpt"),  # step=6.ckpt complete, last.ckpt (step 4) being replaced
    "async-r1": Kill(1, 4, "last.ckpt", async_save=True),  # in the background while step 5 trains
    "between-r1": Kill(1, 5, None),
}


def die_now(marker: Path) -> None:
    """SIGKILL this process, noting when (the test bounds how long the job takes to end after it)."""
    marker.write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


class Dying:
    """Patches DCP's file writer: once armed, the write of ``kill.target``'s staging folder on ``kill.rank``
    flushes ``ITEMS_BEFORE_KILL`` tensors, then SIGKILLs this process (in whichever thread writes)."""

    def __init__(self, kill: Kill, marker: Path) -> None:
        self.kill, self.marker, self.armed, self.items, self.folder = kill, marker, False, 0, ""
        self.write_data, self.write_item = dcp_filesystem._FileSystemWriter.write_data, dcp_filesystem._write_item

    def install(self) -> None:
        original_data, original_item = self.write_data, self.write_item

        def write_data(writer, plan, planner):
            self.folder = str(writer.path)
            return original_data(writer, plan, planner)

        def write_item(transforms, stream, *args, **kwargs):
            result = original_item(transforms, stream, *args, **kwargs)
            if self.armed and RANK == self.kill.rank and self.folder.endswith(f"/{self.kill.target}.partial"):
                self.items += 1
                if self.items == ITEMS_BEFORE_KILL:
                    stream.flush()
                    die_now(self.marker)
            return result

        dcp_filesystem._FileSystemWriter.write_data = write_data
        dcp_filesystem._write_item = write_item


class Record(L.Callback):
    """At every save: the gathered weights and optimizer state (a collective), written by rank 0; arms the kill
    at the scenario's step; kills between steps when the scenario says so."""

    def __init__(self, folder: Path, kill: Kill, dying: Dying) -> None:
        self.folder, self.kill, self.dying, self.seen = folder, kill, dying, set()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        step = trainer.global_step
        if step == self.kill.step:
            # An asynchronous save of an earlier step may still be writing last.ckpt.partial in the background
            # (on a loaded machine): armed now, it would die in that one. Let it commit first, as the strategy
            # does anyway before the next save begins, so the kill lands in this step's save.
            trainer.strategy.checkpoints.saves.wait()
            self.dying.armed = True
        if step in self.seen:
            return
        self.seen.add(step)
        state = snapshot(pl_module, trainer)
        if RANK == 0:
            torch.save(state | {"global_step": torch.tensor(step)}, self.folder / f"step{step}.pt")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.kill.target is None and trainer.global_step == self.kill.step and RANK == self.kill.rank:
            die_now(self.dying.marker)


def trainer_for(devices: int, strategy: VitScaleStrategy, callbacks: list, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
    )


def die(scenario: str, out: Path) -> None:
    kill, folder = SCENARIOS[scenario], out / scenario
    (folder / "saved").mkdir(parents=True, exist_ok=True)
    dying = Dying(kill, folder / "killed")
    dying.install()
    checkpoints = ModelCheckpoint(
        dirpath=folder / "ckpts", filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    L.seed_everything(0, verbose=False)
    strategy = VitScaleStrategy(async_save=kill.async_save)
    trainer_for(2, strategy, [Record(folder / "saved", kill, dying), checkpoints], 8).fit(Classifier(), loader())
    (folder / f"survived-rank{RANK}").write_text("fit returned: the kill never happened")


class Restored(L.Callback):
    """Once the checkpoint is restored, before any step: the gathered state, then stop (nothing is saved)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        state = snapshot(pl_module, trainer)
        if RANK == 0:
            torch.save(state | {"global_step": torch.tensor(trainer.global_step)}, self.path)
        trainer.should_stop = True


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def resume(folder: Path, how: str, devices: int, restored: Path, ckpt_path: str | None = None) -> dict:
    """``how``: ``"last"`` (``ckpt_path="last"``), ``"auto"`` (``auto_resume=True``) or ``"path"`` (``ckpt_path``).
    The ModelCheckpoint saves nothing (no ``save_last``: its end-of-fit save would change the folder)."""
    lines, logger = Lines(), logging.getLogger("lightning.pytorch")  # rank_zero_info's; it does not propagate
    logger.addHandler(lines)
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=1000)
    strategy = VitScaleStrategy(auto_resume=how == "auto")
    trainer = trainer_for(devices, strategy, [Restored(restored), checkpoints], 100)
    facts: dict = {"error": None}
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            trainer.fit(Classifier(), loader(), ckpt_path="last" if how == "last" else ckpt_path)
    except CheckpointError as error:
        facts["error"] = str(error)
    finally:
        logger.removeHandler(lines)
    facts["lines"] = lines.lines + [str(w.message) for w in warned if "lightning_vitscale" in str(w.message)]
    facts["ckpt_path"] = str(trainer.ckpt_path)
    return facts


def shard(folder: Path) -> Path:
    return sorted(folder.glob("*.distcp"))[0]


def damage(source: Path, folder: Path, how: str) -> Path:
    """Rank 0: a copy of ``source`` whose newest checkpoint (``last.ckpt``, and ``step=6.ckpt``, of the same save)
    has one shard damaged; returns the damaged shard of ``last.ckpt``."""
    if RANK == 0:
        shutil.copytree(source, folder)
        for name in ("last.ckpt", "step=6.ckpt"):
            victim = shard(folder / name)
            data = bytearray(victim.read_bytes())
            if how == "flip":
                data[len(data) // 2] ^= 0x01
            victim.write_bytes(bytes(data if how == "flip" else data[: len(data) // 2]))
    if dist.is_initialized():
        dist.barrier()
    return shard(folder / "last.ckpt")


def resume_all(out: Path, devices: int) -> dict:
    results: dict = {}
    restored = out / f"restored-{devices}"
    restored.mkdir(exist_ok=True)
    for scenario in SCENARIOS:
        for how in ("last", "auto"):
            name = f"{scenario}-{how}"
            results[name] = resume(out / scenario / "ckpts", how, devices, restored / f"{name}.pt")
    for how in ("flip", "truncate"):
        folder = out / f"damaged-{how}-{devices}"
        results[f"{how}-shard"] = str(damage(out / "sync-r0" / "ckpts", folder, how))
        for resume_how in ("last", "auto"):
            name = f"{how}-{resume_how}"
            results[name] = resume(folder, resume_how, devices, restored / f"{name}.pt")
        explicit = str(folder / "last.ckpt")
        results[f"{how}-path"] = resume(folder, "path", devices, restored / f"{how}-path.pt", explicit)
    return results


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[-1])
    if mode == "kill":
        die(sys.argv[2], out)
        return
    devices = int(sys.argv[2])
    results = resume_all(out, devices)
    (out / f"resume{devices}-rank{RANK}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
