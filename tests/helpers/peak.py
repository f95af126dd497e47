"""Peak CPU memory of one training step, from the allocator's own events (CPU has no max_memory_allocated).

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of torch's CPU allocator
(op outputs, op-internal buffers, FSDP's storage resizes, gloo's output tensors) with its size. The step's
high-water mark is what was live when the profiler started (every tensor storage reachable by the garbage
collector, deduplicated) plus the largest running sum of those events. RSS is not used: glibc keeps freed
memory, so RSS never goes down and hides what a step really holds.

The profiler (and the CPU allocator's own byte counter) sees a free only on a thread it profiles. Gloo's worker
threads drop the last reference to a collective's buffers (the reduce-scatter input, the all-gather input) when
the work completes, so those frees go unrecorded and a plain running sum drifts upwards through backward (by 6-9
MiB per backward of the 6-block dim-256 ViT on 2 ranks, checked against the garbage-collector count after the
phase). Events are therefore paired by address: an allocation at an address still counted as live proves the
earlier block there was freed unseen, and it is dropped at that point (no later than its real free, so the
result stays an upper bound of the true peak, and a tight one when glibc reuses the address).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

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
    return before, before + _peak_after_mark(prof)


def _walk(nodes: list) -> Iterator:
    for node in nodes:
        yield node
        yield from _walk(node.children)


class AllocatorEvent(NamedTuple):
    """One event of torch's CPU allocator as the profiler records it: ``nbytes`` < 0 is a free."""

    time_ns: int
    thread: int
    address: int
    nbytes: int


def _peak_after_mark(prof: profile) -> int:
    """Largest running sum of the allocator events inside the ``_MARK`` range, frees paired by address."""
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    start = min(n.start_time_ns for n in nodes if n.name == _MARK)
    # The raw allocator events (prof.events() folds allocations into the ops that made them).
    memory = [AllocatorEvent(n.start_time_ns, n.start_tid, n.extra_fields.ptr, n.extra_fields.alloc_size)
              for n in nodes if hasattr(n.extra_fields, "alloc_size")]
    return address_matched_peak(memory, start)


def address_matched_peak(events: Iterable[AllocatorEvent], start: int) -> int:
    """Largest running sum of the events at or after ``start`` (in time order, whatever order they come in: the
    event tree lists them thread by thread), frees paired with allocations by address alone.

    Not by thread: a block allocated on one thread may be freed on another (a collective's buffers), and a
    recorded free must retire its block wherever it happened, or the next allocation there would retire it twice.
    An allocation at an address still live retires the block there: its free went unrecorded.
    """
    live: dict[int, int] = {}
    running = peak = 0
    for event in sorted(events, key=lambda e: (e.time_ns, e.address, e.nbytes)):
        counted = event.time_ns >= start
        if event.nbytes > 0:
            unseen = live.pop(event.address, None)  # freed on a thread the profiler does not see (module docstring)
            if unseen is not None and counted:
                running -= unseen
            live[event.address] = event.nbytes
        else:
            live.pop(event.address, None)
        if counted:
            running += event.nbytes
            peak = max(peak, running)
    return peak


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


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# Every allocation from this size up is its own mmap, unmapped when freed, so freed memory leaves RSS.
MMAP_THRESHOLD = 65536
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}  # the same from process start (fresh processes)


def mmap_large_allocations() -> None:
    """Make every allocation of ``MMAP_THRESHOLD`` bytes or more its own mmap from now on: what
    ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment does at process start (glibc sets the same threshold and
    turns its dynamic adjustment off), called by a rank script itself so that its launch can fork the ranks from
    the test zygote (``tests/helpers/zygote.py``) instead of starting fresh processes for the variable."""
    import ctypes

    if not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


class RssWindow:
    """Peak RSS growth over a window of a process whose large allocations are mmaps (``mmap_large_allocations``).

    Counts what torch's profiler misses on CPU: frees on gloo's worker threads, and memory that is not a tensor
    storage (gloo's copies). ``start`` resets the kernel's high-water mark (``/proc/self/clear_refs``).
    """

    def __init__(self) -> None:
        self.rss_start = 0

    def start(self) -> None:
        gc.collect()
        self.rss_start = status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak_growth(self) -> int:
        return status_bytes("VmHWM") - self.rss_start
