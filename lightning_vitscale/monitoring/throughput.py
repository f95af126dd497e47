"""VitScaleThroughput: samples/s, achieved TFLOP/s, MFU and peak memory per device, logged while training."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from lightning_vitscale._compat import tree_leaves
from lightning_vitscale._utils import GIB
from lightning_vitscale.memory.devices import gpu_named

if TYPE_CHECKING:
    import lightning.pytorch as pl

def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s from the device table (``memory/devices.py``), or ``None`` (CPU, a
    GPU without a trusted figure): MFU needs a trusted denominator."""
    if device.type != "cuda":
        return None
    row = gpu_named(torch.cuda.get_device_name(device))
    return row.bf16_flops_per_s if row is not None else None


def first_dim(batch: Any) -> int:
    """Default batch size: dim 0 of the first tensor in the batch (0 without one)."""
    first = next((leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)), None)
    return 0 if first is None else first.shape[0] if first.dim() else 1


def _edge(device: torch.device) -> Any:
    """A window's edge: a CUDA event recorded with no synchronisation (one per step would drain the queue the host
    keeps ahead of the GPU and charge hidden launch overhead), elsewhere ``time.perf_counter()``."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start: Any, end: Any) -> float:
    if isinstance(end, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class VitScaleThroughput(Callback):
    """Log ``throughput/samples_per_sec`` (all ranks), ``throughput/tflops_per_sec`` and ``throughput/mfu``
    (per device) and peak memory (the largest over ranks) every ``log_every_n_steps`` training batches.

    Unlike Lightning's ``ThroughputMonitor`` it counts FLOPs itself: once, on the first training batch's forward
    (``FlopCounterMode``), times 3 for forward + backward, per sample. *Model* FLOPs, the usual MFU convention:
    recompute and the optimizer are not counted, so MFU compares recipes fairly. That forward runs eagerly
    (dynamo is told so), so keep ``warmup_steps >= 2`` when compiling. Time is device time per window; on CUDA the
    allocator's peak is reset when warm-up ends.

    Args:
        batch_size_fn: ``batch -> samples on this rank``; default: dim 0 of the first tensor in the batch.
        peak_flops: the device's peak FLOP/s; default: the device table's dense bf16 peak on CUDA, none on CPU.
        log_every_n_steps: batches per measurement window.
        warmup_steps: batches ignored before the first window (compilation, allocator warm-up).

    Example::

        monitor = VitScaleThroughput(log_every_n_steps=20)
        Trainer(strategy=VitScaleStrategy(), precision="bf16-mixed", callbacks=[monitor]).fit(model)
        print(monitor.metrics["throughput/mfu"])
    """

    def __init__(
        self, batch_size_fn: Callable[[Any], int] | None = None, peak_flops: float | None = None,
        log_every_n_steps: int = 10, warmup_steps: int = 3,
    ) -> None:
        if log_every_n_steps < 1 or warmup_steps < 0:
            raise ValueError(
                f"need log_every_n_steps >= 1 and warmup_steps >= 0; got {log_every_n_steps} and {warmup_steps}."
            )
        self.batch_size_fn = batch_size_fn or first_dim
        self.peak_flops = peak_flops
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.flops_per_sample: float | None = None
        self.metrics: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self._counter: FlopCounterMode | None = None
        self._eager: Any = None  # torch.compiler.set_stance("force_eager") while the counter is on
        self._counted_samples = 0
        self._batches = 0
        self._window_start: Any = None
        self._window_samples = 0
        self._window_batches = 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.flops_per_sample is None and self._counter is None:
            self._counted_samples = self.batch_size_fn(batch)
            # Eager for the counted forward, said to dynamo rather than left to it: on torch 2.11 a compiled
            # region first called under a dispatch mode is skipped for the rest of the run (no compilation at
            # all; seen on an H200 and on CPU).
            self._eager = torch.compiler.set_stance("force_eager")  # sets it now; __exit__ restores the previous
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        if self.warmup_steps == 0 and self._window_start is None:
            self._start_window(pl_module.device)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._stop_counting()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop_counting()  # a step without backward (e.g. manual optimization that skipped it)
        self._batches += 1
        if self._window_start is None:
            if self._batches >= self.warmup_steps:
                self._start_window(pl_module.device)
            return
        self._window_samples += self.batch_size_fn(batch)
        self._window_batches += 1
        if self._window_batches >= self.log_every_n_steps:
            end = _edge(pl_module.device)
            self._log(trainer, pl_module, _seconds(self._window_start, end))
            self._window_start, self._window_samples, self._window_batches = end, 0, 0

    def _start_window(self, device: torch.device) -> None:
        """Warm-up is over: start the clock, and let the allocator's peak cover the measured steps only."""
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._window_start = _edge(device)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_counting()

    def _stop_counting(self) -> None:
        if self._counter is None:
            return
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self._eager.__exit__(None, None, None)  # entered with the counter
        self.flops_per_sample = 3 * counter.get_total_flops() / max(self._counted_samples, 1)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, seconds: float) -> None:
        device = pl_module.device
        metrics = self.compute(self._window_samples, seconds, trainer.world_size, device)
        if device.type == "cuda":
            key, gib = "memory/peak_allocated_gib", torch.cuda.max_memory_allocated(device) / GIB
        else:  # the process's peak resident set size: ru_maxrss is KiB on Linux, bytes on macOS
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            key, gib = "memory/peak_rss_gib", rss / GIB
        peak = torch.tensor(gib, device=device)
        metrics[key] = float(trainer.strategy.reduce(peak, reduce_op="max")) if trainer.world_size > 1 else gib
        self.metrics = metrics
        self.history.append(metrics)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def compute(self, samples: int, seconds: float, world_size: int, device: torch.device) -> dict[str, float]:
        """Throughput figures for ``samples`` processed on this rank in ``seconds`` (every rank alike)."""
        metrics = {"throughput/samples_per_sec": samples * world_size / seconds}
        if self.flops_per_sample is not None:
            achieved = self.flops_per_sample * samples / seconds
            metrics["throughput/tflops_per_sec"] = achieved / 1e12
            peak = self.peak_flops or device_peak_flops(device)
            if peak:
                metrics["throughput/mfu"] = achieved / peak
        return metrics
