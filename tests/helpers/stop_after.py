"""A callback that ends ``fit`` after a number of epochs without touching ``max_epochs``.

The examples' learning-rate schedules are laid out over ``trainer.estimated_stepping_batches`` (``max_epochs``):
stopping early through this callback keeps every step of the first epochs identical to a full run's, so an
oracle run (DDP) can be cut short and still be compared epoch by epoch with the full run under test.
"""

from __future__ import annotations

import lightning.pytorch as pl


class StopAfterEpochs(pl.Callback):
    def __init__(self, epochs: int) -> None:
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1; got {epochs}")
        self.epochs = epochs

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True
