"""Rank script: sharded checkpoints when several blocks share one FSDP unit (``blocks_per_unit > 1``).

One launch, one process group. Each run saves through ``ModelCheckpoint`` at the end of its first epoch and
trains on to the end of the second. Runs resumed from such a folder with the same or another ``blocks_per_unit``
must find the saved weights, AdamW state and step bit for bit, then log the losses of DDP resumed from DDP's
folder the same way (Lightning's loop does not continue an end-of-epoch checkpoint with the batches of an
uninterrupted run, under DDP neither, so the uninterrupted run is no oracle after a resume). Dropout stays on: each
epoch starts from a seed of its own (``Reseed``), so no strategy's setup shifts the masks. Results:
``OUT/rank<R>.json``, keyed by scenario.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, loader
from tests.helpers.scenarios import run_scenarios
from tests.helpers.state import snapshot

warnings.filterwarnings("ignore")
OUT = Path(sys.argv[1])
STEPS_PER_EPOCH = 4  # 32 samples, 2 ranks, batch 4
SAVED: dict[str, dict[str, torch.Tensor]] = {}  # saving run ("ddp", "k2", ...) -> full state at its save
FINAL: dict[str, dict[str, torch.Tensor]] = {}  # saving run -> model.state_dict() after its two epochs
RESUMED_DDP: list[float] = []  # the oracle: DDP's losses after resuming from its own folder


class Reseed(Callback):
    """Each epoch draws its dropout masks from a seed of its own, so a resumed epoch draws the same ones."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.manual_seed(1000 + trainer.current_epoch)


class Recorded(Classifier):
    """Records the full weights and optimizer state at fit start (what a resume restored) and the first step."""

    def on_train_start(self) -> None:
        self.restored = snapshot(self, self.trainer)
        self.start_step = self.trainer.global_step


class SnapshotAtSave(Callback):
    """The full state where ModelCheckpoint saves (end of the first epoch); Lightning runs it before the save."""

    def __init__(self) -> None:
        self.saved: dict[str, torch.Tensor] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            self.saved = snapshot(pl_module, trainer)


def run_name(per_unit: int | str) -> str:
    return "ddp" if per_unit == "ddp" else f"k{per_unit}"


def fit(per_unit: int | str, ckpt_path: Path | None = None, callbacks: tuple = ()) -> tuple:
    """Two epochs from seed 0 under DDP (``"ddp"``) or ``VitScaleStrategy(blocks_per_unit=per_unit)``."""
    L.seed_everything(0, verbose=False)
    model = Recorded("encoder")
    strategy = "ddp" if per_unit == "ddp" else VitScaleStrategy(blocks_per_unit=int(per_unit))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)), strategy=strategy,
        max_steps=2 * STEPS_PER_EPOCH, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=bool(callbacks),
        callbacks=[Reseed(), *callbacks],
    )
    trainer.fit(model, loader(n=8 * STEPS_PER_EPOCH), ckpt_path=str(ckpt_path) if ckpt_path else None)
    return model, trainer


def units(trainer: L.Trainer) -> int | None:
    plan = getattr(trainer.strategy, "plan", None)
    return plan.units if plan is not None else None


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bit for bit equal (dtype and shape included), and keys only one side has."""
    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


def save(per_unit: int | str) -> dict:
    """Two epochs, ModelCheckpoint saving at the end of the first; the state there and at the end kept."""
    name, at_save = run_name(per_unit), SnapshotAtSave()
    checkpoints = ModelCheckpoint(dirpath=OUT / name, filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                                  save_on_train_epoch_end=True)
    model, trainer = fit(per_unit, callbacks=(at_save, checkpoints))
    SAVED[name] = at_save.saved
    FINAL[name] = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [k for k in at_save.saved if k.startswith("o.") and k.endswith((".exp_avg", ".exp_avg_sq"))]
    return {"units": units(trainer), "global_step": trainer.global_step, "optimizer_moments": len(moments),
            "entries": len(at_save.saved), "losses": model.losses}


def resume(saved_with: int | str, resumed_with: int | str) -> dict:
    """Resume the first-epoch folder of the ``saved_with`` run under ``resumed_with`` to the end of epoch 2."""
    saved = run_name(saved_with)
    model, trainer = fit(resumed_with, ckpt_path=OUT / saved / "epoch=0.ckpt")
    if resumed_with == "ddp":
        RESUMED_DDP.extend(model.losses)
    return {
        "units": units(trainer), "start_step": model.start_step, "global_step": trainer.global_step,
        "restored_differs": differing(model.restored, SAVED[saved]), "restored_entries": len(model.restored),
        "losses": model.losses, "losses_ddp": RESUMED_DDP,
    }


def full_state_dicts() -> dict:
    """``model.state_dict()`` after fit: 2 blocks per unit against 1 block per unit (bit for bit) and DDP."""
    grouped, single, ddp = FINAL["k2"], FINAL["k1"], FINAL["ddp"]
    return {
        "keys_equal_ddp": list(grouped) == list(ddp),
        "types": sorted({type(v).__name__ for v in grouped.values()}),
        "differs_from_k1": differing(grouped, single),
        "largest_difference_from_ddp": max(float((v - ddp[k]).abs().max()) for k, v in grouped.items()),
    }


if __name__ == "__main__":
    run_scenarios({
        "save_ddp": lambda: save("ddp"),
        "resume_ddp_to_ddp": lambda: resume("ddp", "ddp"),
        "save_k2": lambda: save(2),
        "resume_k2_to_k2": lambda: resume(2, 2),
        "resume_k2_to_k1": lambda: resume(2, 1),
        "save_k1": lambda: save(1),
        "resume_k1_to_k3": lambda: resume(1, 3),
        "full_state_dicts": full_state_dicts,
    })
