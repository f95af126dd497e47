"""A user script whose ``fit`` raises on one rank, wrapped in a slow ``except``/``finally`` (e.g. a log upload).

``python failures.py STRATEGY RAISING_RANK OUT HANDLER_S``: Lightning's own launcher starts rank 1; the rank named
raises at step 2; rank 0's handler sleeps ``HANDLER_S`` seconds (an upload, say), then every rank's handler writes
``handled_rank{r}.txt``, and its ``finally`` writes ``finally_rank{r}.txt``. The exit code and the files that
appear are compared with DDP's. ``RAISING_RANK=nan``: rank 1's loss is NaN from step 3 on (bf16-mixed), so the
non-finite guard makes every rank raise ``NonFiniteTrainingError`` at the same step; every rank's handler
sleeps ``HANDLER_S``. A fifth argument ``save``: Lightning's ``OnExceptionCheckpoint`` on every rank, and the
strategy's default timeout (10 minutes: what a save waiting for ranks that never join would wait).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, loader

warnings.filterwarnings("ignore")


class Failing(Classifier):
    def __init__(self, raising_rank: int | None) -> None:
        super().__init__("encoder")
        self.raising_rank = raising_rank

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.raising_rank and batch_idx == 2:
            raise RuntimeError(f"rank {self.raising_rank} failed on purpose")
        loss = super().training_step(batch, batch_idx)
        if self.raising_rank is None and self.global_rank == 1 and batch_idx >= 3:
            loss = loss * float("nan")  # rank 1 only: the guard's all-reduce makes every rank stop together
        return loss


def main() -> None:
    name, failure, out, handler_s = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    save = sys.argv[5:] == ["save"]
    torch.set_num_threads(1)
    rank = os.environ.get("LOCAL_RANK", "0")
    agreed = failure == "nan"
    strategy = VitScaleStrategy(**({} if save else {"timeout": timedelta(seconds=20)})) if name == "vitscale" else name
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=50, logger=False, enable_checkpointing=save,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        precision="bf16-mixed" if agreed else "32-true",
        callbacks=[OnExceptionCheckpoint(out / "saved")] if save else [],
    )
    try:
        trainer.fit(Failing(None if agreed else int(failure)), loader(n=64))
    except Exception as error:
        if rank == "0" or agreed:
            time.sleep(handler_s)
        (out / f"handled_rank{rank}.txt").write_text(str(error))
        raise
    finally:
        (out / f"finally_rank{rank}.txt").write_text("done")


if __name__ == "__main__":
    main()
