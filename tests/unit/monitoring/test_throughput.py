"""VitScaleThroughput in-process on one CPU device: FLOPs and MFU match a hand count, no per-step device sync."""

from __future__ import annotations

import csv
import functools
import types
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale.monitoring.throughput import VitScaleThroughput, device_peak_flops, first_dim
from lightning_vitscale.strategy import VitScaleStrategy

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


def _fit(tmp_path, strategy, monitor: VitScaleThroughput) -> list[dict[str, str]]:
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
    peak = 1e12
    monitor = VitScaleThroughput(peak_flops=peak, log_every_n_steps=2, warmup_steps=1)
    rows = _fit(tmp_path, VitScaleStrategy() if strategy == "vitscale" else "auto", monitor)
    # By hand: forward is one (BATCH x IN) @ (IN x OUT) matmul = 2*IN*OUT FLOPs per sample; its backward computes
    # the input and the weight gradients, one matmul of the same size each: 6*IN*OUT per sample in all.
    hand_flops_per_sample = 2 * IN * OUT + 2 * (2 * IN * OUT)
    assert monitor.flops_per_sample == hand_flops_per_sample
    assert len(rows) == 2  # batches 2-3 and 4-5 (batch 1 is warm-up and starts the clock)
    for row in rows:
        assert float(row["throughput/samples_per_sec"]) > 0
        assert float(row["throughput/tflops_per_sec"]) > 0
        assert 0 < float(row["throughput/mfu"]) < 1
        assert float(row["memory/peak_rss_gib"]) > 0.1
        # MFU = work done per second / peak, from the measured samples/s and the hand count alone.
        expected = hand_flops_per_sample * float(row["throughput/samples_per_sec"]) / peak
        assert float(row["throughput/mfu"]) == pytest.approx(expected, rel=1e-6)


def test_cpu_has_no_peak_so_no_mfu():
    monitor = VitScaleThroughput()
    monitor.flops_per_sample = 1e9
    metrics = monitor.compute(samples=10, seconds=2.0, world_size=2, device=torch.device("cpu"))
    assert metrics == {"throughput/samples_per_sec": 10.0, "throughput/tflops_per_sec": 1e9 * 10 / 2 / 1e12}
    assert device_peak_flops(torch.device("cpu")) is None


def test_batch_size_from_nested_batches():
    assert first_dim((torch.zeros(4, 3), torch.zeros(4))) == 4
    assert first_dim({"meta": "x", "image": torch.zeros(5, 3)}) == 5
    assert first_dim([[], torch.zeros(2)]) == 2


class _Event:
    """``torch.cuda.Event`` stand-in that counts records and waits; time advances 0.5 s per recorded event."""

    log: dict[str, int] = {}
    now = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        _Event.log["record"] += 1
        _Event.now += 0.5
        self.t = _Event.now

    def synchronize(self) -> None:
        _Event.log["wait"] += 1

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


def test_cuda_timing_waits_only_at_window_edges(monkeypatch):
    """Driven through the hooks as on a CUDA device: events at window edges, one wait per window, no device sync."""
    _Event.log = {"record": 0, "wait": 0, "device_sync": 0, "peak_reset": 0}
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: _Event.log.__setitem__("device_sync", 1))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: _Event.log.__setitem__("peak_reset", 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2**30)
    cuda = torch.device("cuda")
    module = types.SimpleNamespace(device=cuda)
    trainer = types.SimpleNamespace(world_size=1, is_global_zero=True, loggers=[], global_step=0)
    monitor = VitScaleThroughput(peak_flops=1e12, log_every_n_steps=3, warmup_steps=2)
    monitor.flops_per_sample = 1e9  # the counting itself is checked on CPU above
    monkeypatch.setattr(torch, "tensor", lambda value, device=None: value)  # no CUDA tensor for the peak
    batch = (torch.zeros(BATCH, IN),)
    waits_per_step = []
    for index in range(2 + 3 * 3):
        monitor.on_train_batch_start(trainer, module, batch, index)
        monitor.on_train_batch_end(trainer, module, None, batch, index)
        waits_per_step.append(_Event.log["wait"])
    assert waits_per_step == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3]  # at the end of steps 5, 8 and 11 only
    assert _Event.log["record"] == 4 and _Event.log["device_sync"] == 0
    assert _Event.log["peak_reset"] == 1
    assert len(monitor.history) == 3
    assert monitor.metrics["throughput/samples_per_sec"] == pytest.approx(3 * BATCH / 0.5)


@pytest.mark.parametrize("monitor", [True, False])
def test_compiled_blocks_still_compile_when_the_first_forward_is_counted(mesh, monitor):
    """The FLOP count's forward runs eagerly by dynamo's stance, not by dynamo giving up on a frame called under a
    dispatch mode: on torch 2.11 that gave up for the whole run (no graph compiled; found on an H200)."""
    from lightning_vitscale.cli.demo import TinyViT, generated_images
    from lightning_vitscale.kernels.settings import KernelPolicy

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiler = functools.partial(torch.compile, backend="eager")  # dynamo without inductor: fast on CPU
    callbacks = [VitScaleThroughput(log_every_n_steps=2, warmup_steps=2)] if monitor else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=VitScaleStrategy(kernels=KernelPolicy(compile_blocks=True,
        compiler=compiler)), max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyViT(dim=32, depth=2), DataLoader(generated_images(32), batch_size=8))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert torch._dynamo.eval_frame._stance.stance == "default"  # the user's stance again
    if monitor:
        assert callbacks[0].flops_per_sample > 0
