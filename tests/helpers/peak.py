"""Peak CPU memory of one training step, from the allocator's own events (CPU has no max_memory_allocated).

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of torch's CPU allocator
(op outputs, op-internal buffers, FSDP's storage resizes, gloo's output tensors) with its size. The step's
high-water mark is what was live when the profiler started (every tensor storage reachable by the garbage
collector, deduplicated) plus the largest running sum of those events. RSS is not used: glibc keeps freed
memory, so RSS never goes down and hides what a step really holds.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_vitscale._compat import FakeTensor


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive now (DTensors by their local shard), each storage counted once."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # touching deprecated module attributes while scanning
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            if obj.is_meta or isinstance(obj, FakeTensor):
                continue
            local = getattr(obj, "_local_tensor", obj)
            if local.device.type != "cpu":
                continue
            storage = local.untyped_storage()
            if storage.data_ptr():  # no address: fake tensors, or storages FSDP resized to 0
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage, fake tensors
            continue
    return sum(seen.values())


def step_peak_bytes(step: Callable[[], object], warmup: Callable[[], object] | None = None) -> tuple[int, int]:
    """Run ``warmup`` then ``step``; return (bytes live when ``step`` starts, peak bytes live during it).

    The profiler runs through ``warmup`` too: it reports a free only for blocks it saw allocated, so the previous
    step's gradients (freed by ``zero_grad``) and other per-step buffers must be allocated while it listens.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        if warmup is not None:
            warmup()
        gc.collect()
        before = live_tensor_bytes()
        with record_function(_MARK):
            step()
    events = list(prof.profiler.kineto_results.events())
    start = min(e.start_ns() for e in events if e.name() == _MARK)
    # The raw allocator events, in time order (prof.events() folds allocations into the ops that made them).
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.start_ns() >= start)
    running = peak = 0
    for _, nbytes in memory:
        running += nbytes
        peak = max(peak, running)
    return before, before + peak


_MARK = "vitscale::measured_step"


def phased_step_peak(phases: list[Callable[[], object]]) -> tuple[int, int]:
    """Peak of a step made of ``phases`` (e.g. zero_grad+forward, backward, optimizer step), each phase measured
    from its own garbage-collector baseline after a full step and the phases before it.

    A fresh baseline per phase bounds the error of frees the profiler does not see (buffers of a collective
    released by gloo's worker thread are freed outside the profiled thread) to one phase instead of the step.
    """
    before, peak = 0, 0
    for index, phase in enumerate(phases):

        def warmup(index: int = index) -> None:
            for earlier in phases + phases[:index]:
                earlier()

        start, high = step_peak_bytes(phase, warmup=warmup)
        before = before if index else start
        peak = max(peak, high)
    return before, peak
