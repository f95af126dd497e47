"""ThroughputMonitor in-process on one CPU device: FLOPs match a hand count, columns reach the logger."""

from __future__ import annotations

import csv
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale.strategy import VitScaleStrategy
from lightning_vitscale.throughput import ThroughputMonitor, device_peak_flops, first_dim

IN, OUT, BATCH = 32, 16, 8


class LinearModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, strategy, monitor: ThroughputMonitor) -> list[dict[str, str]]:
    data = TensorDataset(torch.randn(6 * BATCH, IN), torch.randn(6 * BATCH, OUT))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=6, logger=CSVLogger(tmp_path, name="run"),
        callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LinearModel(), DataLoader(data, batch_size=BATCH))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("throughput/samples_per_sec")]


@pytest.mark.parametrize("strategy", ["auto", "vitscale"])
def test_logs_throughput_and_counts_model_flops(tmp_path, mesh, strategy):
    monitor = ThroughputMonitor(peak_flops=1e12, log_every_n_steps=2, warmup_steps=1)
    rows = _fit(tmp_path, VitScaleStrategy() if strategy == "vitscale" else "auto", monitor)
    # forward: one (BATCH x IN) @ (IN x OUT) matmul = 2*IN*OUT*BATCH; forward + backward counted as 3x that.
    assert monitor.flops_per_sample * BATCH == 3 * 2 * IN * OUT * BATCH
    assert len(rows) == 2  # batches 2-3 and 4-5 (batch 1 is warm-up and starts the clock)
    for row in rows:
        assert float(row["throughput/samples_per_sec"]) > 0
        assert float(row["throughput/tflops_per_sec"]) > 0
        assert 0 < float(row["throughput/mfu"]) < 1
        assert float(row["memory/peak_rss_gib"]) > 0.1
    m = monitor.metrics
    assert m["throughput/mfu"] == pytest.approx(m["throughput/tflops_per_sec"] * 1e12 / 1e12)


def test_cpu_has_no_peak_so_no_mfu():
    monitor = ThroughputMonitor()
    monitor.flops_per_sample = 1e9
    metrics = monitor.compute(samples=10, seconds=2.0, world_size=2, device=torch.device("cpu"))
    assert metrics == {"throughput/samples_per_sec": 10.0, "throughput/tflops_per_sec": 1e9 * 10 / 2 / 1e12}
    assert device_peak_flops(torch.device("cpu")) is None


def test_batch_size_from_nested_batches():
    assert first_dim((torch.zeros(4, 3), torch.zeros(4))) == 4
    assert first_dim({"meta": "x", "image": torch.zeros(5, 3)}) == 5
    assert first_dim([[], torch.zeros(2)]) == 2
