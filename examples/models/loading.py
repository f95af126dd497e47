"""Data loading that keeps up: DataLoader defaults per accelerator, and a callback that times the loader.

Why here and not in each datamodule: every example (classification, detection, video, pretraining) shares
one answer to "how many workers, pinned or not", and one way to see whether the loader is the bottleneck.

* ``loader_settings`` picks workers / pin-memory / persistent workers from where the tensors go: in-memory
  tensors need no worker (a worker only adds an inter-process copy); decoded-from-disk data on a GPU gets up
  to 8 workers per rank (the cores split between the ranks on the node, one left for the main process),
  pinned memory (faster, async host-to-device copies) and persistent workers (no re-fork every epoch).
* ``DataWaitTimer`` logs ``time/data_wait_ms`` (the training loop waiting for the next batch) next to
  ``time/step_ms`` (forward, backward, optimizer) every step, and prints the share of time spent waiting at
  the end of each training epoch: a large share means more workers, or faster decoding, not a bigger GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

MAX_WORKERS_PER_RANK = 8  # beyond ~8 decode workers per GPU the returns vanish and host memory grows


@dataclass(frozen=True)
class LoaderSettings:
    """The DataLoader keyword arguments this module chooses (``as_kwargs`` feeds them to ``DataLoader``)."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
        }


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's count: containers and taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def loader_settings(
    accelerator: str, ranks_per_node: int, in_memory: bool, num_workers: int | None = None, cpus: int | None = None
) -> LoaderSettings:
    """Defaults for one rank's DataLoader; an explicit ``num_workers`` always wins.

    Args:
        accelerator: ``"cpu"``, ``"cuda"``, ``"mps"``, ... (the trainer's accelerator).
        ranks_per_node: processes sharing this node's CPUs (the trainer's devices per node).
        in_memory: the dataset holds ready tensors (no decoding), so workers cannot speed it up.
        num_workers: the user's choice; ``None`` picks the default described in the module docstring.
        cpus: CPUs available to this node's ranks (defaults to this process's affinity mask).
    """
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0 (or None for the per-accelerator default)")
    if num_workers is None:
        per_rank = (cpus or available_cpus()) // max(1, ranks_per_node)
        if in_memory:
            num_workers = 0
        elif accelerator == "cpu":  # the model computes on these very cores: decode with at most two helpers
            num_workers = min(2, max(0, per_rank - 1))
        else:
            num_workers = min(MAX_WORKERS_PER_RANK, max(1, per_rank - 1))
    pin = accelerator == "cuda"  # page-locked host memory only pays off for copies to a CUDA device
    return LoaderSettings(num_workers, pin, num_workers > 0)


def trainer_loader_settings(
    trainer: pl.Trainer | None, in_memory: bool, num_workers: int | None = None
) -> LoaderSettings:
    """``loader_settings`` for the trainer a datamodule is attached to (CPU defaults when there is none)."""
    if trainer is None:
        return loader_settings("cpu", 1, in_memory, num_workers)
    accelerator = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
    return loader_settings(accelerator, trainer.num_devices, in_memory, num_workers)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    trainer: pl.Trainer | None,
    in_memory: bool,
    num_workers: int | None = None,
    collate_fn: Callable | None = None,
) -> DataLoader:
    """A DataLoader with this module's defaults; Lightning adds the distributed sampler on top."""
    settings = trainer_loader_settings(trainer, in_memory, num_workers)
    return DataLoader(dataset, batch_size, shuffle=shuffle, collate_fn=collate_fn, **settings.as_kwargs())


class DataWaitTimer(pl.Callback):
    """Logs per training step the time spent waiting for the batch and the time spent computing on it.

    ``data_wait`` runs from the end of one training batch to the start of the next (the loader's
    ``next()``, the host-to-device copy and Lightning's hooks), ``step`` from start to end of the batch.
    Both are this rank's wall-clock times; with asynchronous devices the step time includes waiting for
    the device only where the step synchronises (the loss ``.item()`` of the progress bar, the logger).
    """

    def __init__(self, warn_above: float = 0.2) -> None:
        super().__init__()
        self.warn_above = warn_above
        self._batch_end: float | None = None
        self._batch_start = 0.0
        self._wait = self._step = 0.0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch_end = time.perf_counter()  # the epoch's first wait includes creating the loader's iterator
        self._wait = self._step = 0.0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()
        if self._batch_end is not None:
            wait = self._batch_start - self._batch_end
            self._wait += wait
            pl_module.log("time/data_wait_ms", 1e3 * wait, on_step=True, on_epoch=False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_end = time.perf_counter()
        step = self._batch_end - self._batch_start
        self._step += step
        pl_module.log("time/step_ms", 1e3 * step, on_step=True, on_epoch=False)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = self._wait + self._step
        if total <= 0:
            return
        share = self._wait / total
        hint = " -- the loader is the bottleneck: raise --data.num_workers" if share > self.warn_above else ""
        rank_zero_info(f"epoch {trainer.current_epoch}: waited for data {100 * share:.0f}% of the step time{hint}")
