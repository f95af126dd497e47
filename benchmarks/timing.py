"""Timing windows for training benchmarks: device time between window edges, no synchronisation per step.

Synchronising the device after every step (as a naive ``time.perf_counter`` loop must) drains the queue the host
builds ahead of the GPU, so a configuration that launches many small kernels is charged its launch overhead in
full, where real training would hide part of it. Here an edge is a CUDA event recorded on the stream (recording
does not wait), edges are taken only at the end of warm-up and at the end of each window, and an interval is read
(one ``Event.synchronize``) only when asked for, after the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class CudaClock:
    """Edges are CUDA events on the current stream; reading an interval waits for its end event only."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class HostClock:
    """CPU fallback: ``perf_counter`` at the edges (on a CPU device the host does the work, nothing is queued)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


def clock_for(device: torch.device) -> CudaClock | HostClock:
    return CudaClock() if device.type == "cuda" else HostClock()


class WindowTimer:
    """Call :meth:`step` after every training step.

    Steps ``1..warmup`` are not timed (compilation, allocator and cuDNN warm-up); then ``windows`` back-to-back
    windows of ``steps_per_window`` steps each. ``on_measure_start`` runs once, when warm-up ends (e.g.
    ``torch.cuda.reset_peak_memory_stats`` so peak memory covers the timed steps only).
    """

    def __init__(
        self,
        warmup: int,
        steps_per_window: int,
        windows: int,
        clock: CudaClock | HostClock,
        on_measure_start: Callable[[], None] | None = None,
    ) -> None:
        if warmup < 0 or steps_per_window < 1 or windows < 1:
            raise ValueError(
                f"need warmup >= 0, steps_per_window >= 1, windows >= 1; got {warmup}, {steps_per_window}, {windows}"
            )
        self.warmup, self.steps_per_window, self.windows = warmup, steps_per_window, windows
        self.clock = clock
        self.on_measure_start = on_measure_start
        self.steps = 0
        self.edges: list[Any] = []
        if warmup == 0:
            self._start_measuring()

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps_per_window * self.windows

    @property
    def done(self) -> bool:
        return len(self.edges) == self.windows + 1

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.warmup:
            self._start_measuring()
        elif self.steps > self.warmup and not self.done and (self.steps - self.warmup) % self.steps_per_window == 0:
            self.edges.append(self.clock.mark())

    def _start_measuring(self) -> None:
        if self.on_measure_start is not None:
            self.on_measure_start()
        self.edges.append(self.clock.mark())

    def window_seconds(self) -> list[float]:
        """Seconds per finished window; reads the edges (on CUDA: waits for each window's end event)."""
        return [self.clock.seconds(a, b) for a, b in zip(self.edges, self.edges[1:])]


@dataclass(frozen=True)
class Spread:
    """Median and range of a per-window quantity."""

    median: float
    low: float
    high: float
    n: int

    @property
    def relative_range(self) -> float:
        """(max - min) / median: how much the windows disagree."""
        return (self.high - self.low) / self.median if self.median else float("nan")


def summarize(values: list[float]) -> Spread:
    if not values:
        raise ValueError("no finished window to summarize: run more steps than warmup + one window")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def rates(samples_per_step: int, steps_per_window: int, seconds: list[float]) -> list[float]:
    """Samples per second in each window."""
    return [samples_per_step * steps_per_window / s for s in seconds]
