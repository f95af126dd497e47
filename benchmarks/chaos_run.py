"""The job of the chaos run (``benchmarks/chaos.py``): every attempt, first or requeued, runs this same command.

``python benchmarks/chaos_run.py RUN_DIR --steps N --cache DIR``: the classification example's model
(``ViTClassifier(size="tiny")``) on the digits streamed from tar shards (``ShardImageDataModule``, 2 loader workers
per rank, batches of 64: 12 steps an epoch) under ``VitScaleStrategy(async_save=True, auto_resume=True)`` with its
sharding settings spelled out (a change of defaults does not change this run), ``ShardedEMA(evaluate="both")``,
validation every 6 steps, and a ``ModelCheckpoint`` every 3 steps (the newest 2, and ``last.ckpt``, replaced each
time; a monitored loss would not do: each rank ranks by its own loss, and a resume gives every rank rank 0's
ranking, under DDP as here) on 2 CPU ranks started by Lightning's own launcher. ``auto_resume`` makes the same
command resume.

The driver says where an attempt dies in ``RUN_DIR/plan.json`` (``{"attempt", "rank", "kind", "at", "signal",
"variant"}``; none: no kill). Kills at a moment of the driver's own choosing (``timed``) it sends itself; for the
others the rank sends the signal to itself (``os.kill`` of its own pid, what the driver's would be) at the
``at``-th occurrence, in this attempt, of: a training step beginning (``step``), a validation batch (``validation``,
the EMA pass included), a checkpoint write in the background, one tensor into its shard (``save``), a checkpoint
folder replaced by its new save, between the old one's marker removal and its removal (``commit``, variant
``unmarked``) or between that removal and the move of the new one (variant ``retired``; rank 0, which commits), an
old checkpoint's removal (``remove``), and the restore of a checkpoint (``restore``). Each rank records its pid
(``pids/rank<r>``), what it last began (``phase-rank<r>``), each step's loss (``losses-rank<r>.jsonl``), a kill it
sends itself just before (``kills.jsonl``), and ``done-rank<r>`` when ``fit`` returned.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the checkout's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.classification import ViTClassifier
from examples.models.shard_data import ShardImageDataModule
from lightning_vitscale import ShardedEMA, VitScaleStrategy
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER
from tests.helpers.launch import record_identity

# the modules whose `retire` the chaos wraps: each looks it up in its own globals
commit_module = importlib.import_module("lightning_vitscale.checkpoint.commit")
save_module = importlib.import_module("lightning_vitscale.checkpoint.save")

BATCH, WORKERS, SAVE_EVERY, VAL_EVERY = 64, 2, 3, 6
KINDS = ("timed", "step", "validation", "save", "commit", "remove", "restore")


def strategy() -> VitScaleStrategy:
    """Every setting that shapes the numbers spelled out: the run is the same whatever the defaults become."""
    return VitScaleStrategy(
        async_save=True, auto_resume=True, activation_checkpointing=True, blocks_per_unit=1,
        reshard_after_forward=True, kernels="eager", sharding="full", accumulation="auto",
    )  # fmt: skip


class Chaos(pl.Callback):
    """Records this rank's pid, phase and losses; sends the planned signal to this process at the planned moment."""

    def __init__(self, run: Path, plan: dict[str, Any] | None) -> None:
        self.run, self.plan, self.start = run, plan or {}, time.time()
        self.counts = dict.fromkeys(KINDS, 0)
        self.rank, self.trainer = 0, None
        self.armed = False  # a save of this attempt is to die in its background write
        (run / "pids").mkdir(exist_ok=True)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rank, self.trainer = trainer.global_rank, trainer
        record_identity(self.run / "pids" / f"rank{self.rank}")  # pid and start time: a later process's pid differs
        self.phase("setup")

    def phase(self, text: str) -> None:
        path = self.run / f"phase-rank{self.rank}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"phase": text, "t": time.time() - self.start}))
        os.replace(tmp, path)

    def occurred(self, kind: str, what: str) -> None:
        """The ``kind`` event begins on this rank: the planned signal, if it is the planned occurrence."""
        self.counts[kind] += 1
        if self.planned(kind):
            self.die(what)

    def planned(self, kind: str) -> bool:
        plan = self.plan
        return plan.get("kind") == kind and plan.get("rank") == self.rank and self.counts[kind] == plan.get("at")

    def die(self, what: str) -> None:
        step = self.trainer.global_step if self.trainer is not None else None
        moment = {**self.plan, "step": step, "phase": what, "wall": time.time()}
        with open(self.run / "kills.jsonl", "a") as f:
            f.write(json.dumps(moment) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), getattr(signal, self.plan["signal"]))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.phase(f"training step {trainer.global_step}")
        self.occurred("step", f"training step {trainer.global_step} begins")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        record = {"step": trainer.global_step - 1, "loss": float(loss), "attempt": self.plan.get("attempt")}
        with open(self.run / f"losses-rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:  # fmt: skip
        self.phase(f"validation batch {batch_idx} after step {trainer.global_step}")
        self.occurred("validation", f"validation batch {batch_idx} after step {trainer.global_step}")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.phase(f"saving step {trainer.global_step}")
        self.counts["save"] += 1
        # The planned save dies in its background write, one tensor in. Armed until a write disarms it: Lightning's
        # ModelCheckpoint saves twice at once (`step=N.ckpt`, `last.ckpt`), and the second's call came before the
        # first's write, so a kill planned at an odd save never landed (seeds 11 and 12: no kill at all).
        self.armed = self.armed or self.planned("save")

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.phase(f"restoring step {checkpoint.get('global_step')}")
        self.occurred("restore", f"restoring step {checkpoint.get('global_step')}")

    def install(self) -> None:
        """Wrap what a save, a commit and a removal do, to die inside them (the package's own code runs)."""
        write_item, retire_on_commit, retire_on_remove = (
            dcp_filesystem._write_item, commit_module.retire, save_module.retire
        )

        def _write_item(*args: Any, **kwargs: Any) -> Any:
            result = write_item(*args, **kwargs)
            if self.armed:
                self.armed = False
                self.die("writing its shard of a save in the background")
            return result

        def retire_on_publish(location: Any) -> None:
            if not location.is_dir():
                return retire_on_commit(location)
            if self.plan.get("variant") == "unmarked":
                location.child(SHARDED_MARKER).remove()
                self.occurred("commit", f"committing {location.url}: the old folder's marker removed")
            retire_on_commit(location)
            if self.plan.get("variant") != "unmarked":
                self.occurred("commit", f"committing {location.url}: the old folder removed, the new not moved")
            return None

        def retire_removed(location: Any) -> None:
            retire_on_remove(location)
            if location.exists() is False and not str(location.url).endswith(".partial"):
                self.occurred("remove", f"removing {location.url}")

        dcp_filesystem._write_item = _write_item
        commit_module.retire = retire_on_publish
        save_module.retire = retire_removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--cache", required=True, help="where the digits are written once as tar shards")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    plan_file = args.run / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    chaos = Chaos(args.run, plan)
    chaos.install()
    pl.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(
        dirpath=args.run / "ckpts", filename="{step}", every_n_train_steps=SAVE_EVERY, monitor="step", mode="max",
        save_top_k=2, save_last=True,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(), precision="32-true", max_steps=args.steps,
        val_check_interval=VAL_EVERY, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ShardedEMA(decay=0.9, warmup=True, evaluate="both"), checkpoints, chaos],
    )  # fmt: skip
    data = ShardImageDataModule(batch_size=BATCH, num_workers=WORKERS, shuffle_buffer=200, cache_dir=args.cache)
    trainer.fit(ViTClassifier(size="tiny"), data)
    (args.run / f"done-rank{trainer.global_rank}").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
