"""User-style script run by Lightning's own launcher: the drop-in path, world size 1, and a hanging rank."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch

import lightning_vitscale  # noqa: F401  (registers strategy="vitscale")
from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, loader

warnings.filterwarnings("ignore")


class Reseeded(Classifier):
    """Starts training from the same RNG state whatever the strategy did during setup (DDP-style reset_seed)."""

    def on_train_start(self) -> None:
        torch.manual_seed(1)


class Hanging(Classifier):
    """Rank 1 hangs at step 2 while rank 0 waits in a collective (a raising rank: scripts/failures.py)."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            time.sleep(3600)
        return super().training_step(batch, batch_idx)


def fit(strategy, devices: int, model: L.LightningModule, steps: int = 6, **kwargs) -> L.Trainer:
    trainer = L.Trainer(**kwargs,
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, loader(n=64))
    return trainer


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode == "hang":
        fit(VitScaleStrategy(timeout=timedelta(seconds=8)), 2, Hanging("encoder"), steps=50)
        return
    if mode == "single":
        results = {}
        for name, strategy in (("single_device", "auto"), ("vitscale", "vitscale")):
            L.seed_everything(0, verbose=False)
            model = Reseeded("encoder")
            # Lightning's injected DistributedSampler always shuffles training data, so compare on the
            # user's own (sequential) loader: the oracle is plain single-device training on identical batches.
            trainer = fit(strategy, 1, model, use_distributed_sampler=False)
            results[name] = {"losses": model.losses, "strategy": type(trainer.strategy).__name__}
    else:  # "dropin": strategy given by registry name, Lightning's launcher starts rank 1
        # Registered before fit, so it runs after any exit handler the strategy registers (atexit is LIFO).
        rank_id = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        atexit.register(lambda: (out / f"{mode}_exit_rank{rank_id}.txt").write_text(
            "group destroyed" if not torch.distributed.is_initialized() else "group alive"))
        L.seed_everything(0, verbose=False)
        model = Classifier("encoder")
        trainer = fit(mode, 2, model)
        results = {
            "losses": model.losses,
            "strategy": type(trainer.strategy).__name__,
            "cluster": type(trainer.strategy.cluster_environment).__name__,
        }
    rank = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
