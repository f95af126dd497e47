"""The batch the planner measures, and how: ``example_input_array`` through ``forward``, or one batch of the
training data through ``training_step``, so that the default ``VitScaleStrategy()`` gets the planner's choice
without ``example_input_array`` and a LightningModule without ``forward`` (its ``training_step`` calls a
backbone) gets it too.

The training batch is fetched at setup, before the units are made (they cannot change afterwards, and a hook may
call the model before the first step): the first ``batch_size`` samples of the train ``DataLoader``'s dataset,
collated as the loader collates them, on every rank alike (no worker, no sampler). A dataset's random transforms
and a ``training_step``'s random calls do draw numbers, so reading and measuring run with the global generators
(torch, Python's ``random``, NumPy's) saved and restored: training afterwards sees the same random numbers as
under DDP, which plans nothing. It is
measured as ``training_step(batch, 0)`` on a meta twin of the module (structure, no data: the real module's
Python state is not touched) on fake tensors, with ``self.log`` silenced, the module's torchmetrics metrics left
out and ``.item()`` a symbolic number; a ``training_step`` that cannot run there (it branches on a value) is
measured through ``forward`` on the batch's first tensor where the module has one. Batch-transfer hooks
(``on_after_batch_transfer``) are not applied.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_vitscale._compat import train_dataloader
from lightning_vitscale.discovery.tensor_plan import TensorPlanError
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_model import StepInputs
from lightning_vitscale.memory.twin import meta_twin

EXAMPLE_INPUT = "example_input_array"
TRAIN_BATCH = "one batch of the train dataloader"
FIRST_STEP = "the first training batch"


@dataclass(frozen=True)
class PlanningBatch:
    """What the planner measures: ``value`` fed to ``forward`` (``example_input_array``) or, with
    ``through_training_step``, a batch as ``training_step`` receives it; ``source`` says where it came from."""

    value: Any
    source: str
    through_training_step: bool = False


def planning_batch(module: nn.Module, trainer: Any | None) -> PlanningBatch | None:
    """``example_input_array`` when the module sets it; else, while fitting (``trainer`` given), the first batch
    of the train ``DataLoader`` (see the module docstring); ``None`` when neither is there."""
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return PlanningBatch(example, EXAMPLE_INPUT)
    if trainer is None:
        return None
    batch = first_batch(train_dataloader(trainer))
    return None if batch is None else PlanningBatch(batch, TRAIN_BATCH, through_training_step=True)


def first_batch(loader: Any) -> Any | None:
    """The first ``batch_size`` samples of a ``DataLoader`` over a map-style dataset, collated; ``None`` for
    anything else (an iterable may be consumed by reading it, a sampler draws random numbers)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) or not loader.batch_size:
        return None
    try:
        size = min(loader.batch_size, len(loader.dataset))  # type: ignore[arg-type]
    except TypeError:  # a dataset without len()
        return None
    if not size:
        return None
    with random_state_kept():  # random transforms (flips, crops) must not shift the training run's numbers
        return loader.collate_fn([loader.dataset[i] for i in range(size)])


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Run the body with torch's (CPU and initialised CUDA devices), Python's and NumPy's global random states
    saved and restored."""
    state = random.getstate()
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)


def _numpy_random() -> Any | None:
    try:
        import numpy
    except ImportError:  # NumPy is optional for torch
        return None
    return numpy.random


def first_tensor_input(batch: Any) -> Any:
    """The model input in a batch as Lightning passes it: a tensor, or the first element of a tuple/list/dict."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch:
        return first_tensor_input(batch[0])
    if isinstance(batch, dict) and batch:
        return first_tensor_input(next(iter(batch.values())))
    raise ValueError(
        f"activation_checkpointing='auto' could not find the model input in a batch of type {type(batch).__name__}."
        " Set `self.example_input_array` in the LightningModule, or pass activation_checkpointing=True."
    )


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines ``forward`` (a LightningModule need not: its ``training_step`` may call a
    backbone)."""
    forward = getattr(type(module), "forward", None)
    return forward is not None and forward is not nn.Module.forward and (
        not hasattr(module, "training_step") or is_overridden("forward", module))


def runs_training_step(module: nn.Module) -> bool:
    """Whether ``training_step`` can be measured: a LightningModule's own, under automatic optimization (a manual
    one steps the optimizer itself)."""
    return is_overridden("training_step", module) and bool(getattr(module, "automatic_optimization", True))


def training_step_call(model: nn.Module, batch: Any) -> Any:
    """``model.training_step(batch, 0)`` with ``self.log`` / ``self.log_dict`` silenced and the module's
    torchmetrics metrics left out (:func:`_metrics_silenced`); its loss."""
    with _silenced(model, ("log", "log_dict", "print")), _metrics_silenced(model):
        out = model.training_step(batch, 0)  # type: ignore[operator]
    return out.get("loss") if isinstance(out, Mapping) else out


@contextlib.contextmanager
def _metrics_silenced(model: nn.Module) -> Iterator[None]:
    """Calls to the twin's ``torchmetrics`` metrics (``self.train_acc(preds, y)``, ``.update``) do nothing.

    Their states are plain tensors, not buffers, so the meta twin holds real ones that fake tensors cannot meet;
    updating a metric in ``training_step`` is Lightning's most common pattern, and without this every such module
    was measured a second time through ``forward``. What a metric keeps is a few numbers, not activations, and its
    value only reaches ``self.log`` (silenced): a step that computes with it fails here and falls back as before."""
    metric_class = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    metrics = [m for m in model.modules() if metric_class is not None and isinstance(m, metric_class)]
    for metric in metrics:
        _silenced_calls(metric, ("forward", "update"))
    try:
        yield
    finally:
        for metric in metrics:
            for name in ("forward", "update"):
                metric.__dict__.pop(name, None)


@contextlib.contextmanager
def _silenced(model: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """No-op instance attributes over ``names`` for the measurement (``model`` is the planner's own twin)."""
    _silenced_calls(model, names)
    try:
        yield
    finally:
        for name in names:
            model.__dict__.pop(name, None)


def _silenced_calls(module: nn.Module, names: tuple[str, ...]) -> None:
    def nothing(*_: Any, **__: Any) -> None:
        return None

    for name in names:
        object.__setattr__(module, name, nothing)



def measure_batch(model: nn.Module, batch: PlanningBatch, **step_kwargs: Any) -> tuple[StepInputs, str]:
    """:func:`~.planner.step_inputs` for ``batch`` (keyword arguments passed on), and how it was measured (for the
    summary). A training batch runs through ``training_step`` on a meta twin, else (a manual-optimization module,
    or a ``training_step`` that cannot run on fake tensors) through ``forward`` on its first tensor; a module
    with neither raises what the measurement raised."""
    with random_state_kept():  # a training_step's random calls must not shift the training run's numbers
        return _measure_batch(model, batch, **step_kwargs)


def _measure_batch(model: nn.Module, batch: PlanningBatch, **step_kwargs: Any) -> tuple[StepInputs, str]:
    how = ""
    if batch.through_training_step and runs_training_step(model):
        try:
            inputs = step_inputs(meta_twin(model), batch.value, call=training_step_call, **step_kwargs)
            return inputs, f"{batch.source}, through training_step"
        except TensorPlanError:
            raise
        except Exception as error:
            if not has_forward(model):
                raise
            how = f" (training_step could not run on fake tensors: {type(error).__name__})"
    value = first_tensor_input(batch.value) if batch.through_training_step else batch.value
    return step_inputs(model, value, **step_kwargs), f"{batch.source}, through forward{how}"
