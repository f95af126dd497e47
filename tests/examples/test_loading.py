"""The examples' DataLoader defaults per accelerator and the data-wait timer, on one process in seconds."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from examples.models import loading
from examples.models.loading import DataWaitTimer, loader_settings

pytestmark = pytest.mark.timeout(120)


def test_in_memory_data_gets_no_workers() -> None:
    for accelerator in ("cpu", "cuda"):
        s = loader_settings(accelerator, ranks_per_node=8, in_memory=True, cpus=96)
        assert (s.num_workers, s.persistent_workers) == (0, False)


def test_decoded_data_on_gpus_splits_the_node_cpus() -> None:
    assert loader_settings("cuda", 8, in_memory=False, cpus=96).as_kwargs() == {
        "num_workers": 8,
        "pin_memory": True,
        "persistent_workers": True,
    }  # 12 per rank, capped at 8
    assert loader_settings("cuda", 8, in_memory=False, cpus=32).num_workers == 3  # 4 per rank, one for the main
    assert loader_settings("cuda", 8, in_memory=False, cpus=8).num_workers == 1  # never 0 on a GPU


def test_decoded_data_on_cpu_leaves_cores_for_compute() -> None:
    s = loader_settings("cpu", 2, in_memory=False, cpus=2)
    assert (s.num_workers, s.pin_memory, s.persistent_workers) == (0, False, False)
    assert loader_settings("cpu", 1, in_memory=False, cpus=16).num_workers == 2


def test_explicit_workers_win_and_negative_fails() -> None:
    assert loader_settings("cuda", 8, in_memory=True, num_workers=4, cpus=96).num_workers == 4
    with pytest.raises(ValueError, match="must be >= 0"):
        loader_settings("cpu", 1, in_memory=True, num_workers=-1)


class _Clock:
    """A fake ``time.perf_counter`` advanced only by the dataset and the model: exact, load-independent spans."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _SlowData(Dataset):
    """Each sample takes 40 ms (fake) to "decode": the loader, not the model, is the bottleneck."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Tensor:
        self.clock.now += 0.040
        return torch.full((4,), float(i))


class _Model(pl.LightningModule):
    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.clock = clock

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        self.clock.now += 0.010  # 10 ms of "compute"
        return self.lin(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_data_wait_and_step_time_are_logged_apart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(loading, "time", SimpleNamespace(perf_counter=clock))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="t"),
        log_every_n_steps=1,
        callbacks=[DataWaitTimer()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(_Model(clock), DataLoader(_SlowData(clock), batch_size=2))
    rows = list(csv.DictReader((tmp_path / "t" / "version_0" / "metrics.csv").open()))
    wait = [float(r["time/data_wait_ms"]) for r in rows if r.get("time/data_wait_ms")]
    step = [float(r["time/step_ms"]) for r in rows if r.get("time/step_ms")]
    # 2 samples x 40 ms per batch; the last step has no next batch to prefetch (Lightning fetches one ahead)
    assert wait == pytest.approx([80.0, 80.0, 80.0, 80.0]), wait
    assert step == pytest.approx([10.0, 10.0, 10.0, 10.0]), step
    assert "waited for data 89% of the step time -- the loader is the bottleneck" in caplog.text
