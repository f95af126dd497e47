"""SIGTERM under VitScaleStrategy: the strategy's handler, which takes the place of Lightning's (that one broadcasts
inside the signal handler: ``distributed/sigterm.py``), still does the rest of Lightning's job in one process: the
fit stops after the batch the signal arrived in, with Lightning's exit, and the handler the user had installed runs.
The lone-rank hang itself is ``tests/distributed/test_chaos.py``'s. Mutation seen failing: ``_on_sigterm`` without
``mark_sigterm_received`` (the fit ran on to ``max_steps``); without the loop over ``others`` (no user handler)."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.distributed import sigterm


class SignalledAtBatch2(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.handlers: list[object] = []

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            self.handlers.append(signal.getsignal(signal.SIGTERM))
            os.kill(os.getpid(), signal.SIGTERM)
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_sigterm_stops_the_fit_after_its_batch_and_runs_the_users_handler(mesh):
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        model = SignalledAtBatch2()
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(), max_steps=10, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        with pytest.raises(SystemExit):  # Lightning's own ending of a SIGTERM'd run: exit code 1
            trainer.fit(model, DataLoader(torch.randn(40, 2), batch_size=2))
        assert getattr(model.handlers[0], "func", None) is sigterm._on_sigterm  # Lightning's was replaced
        assert trainer.global_step == 3 and seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
