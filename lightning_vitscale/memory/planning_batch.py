"""The batch the planner measures: ``example_input_array`` through ``forward``, or one training batch through
``training_step`` (the default plans without ``example_input_array``, and without ``forward``).

The training batch is read at setup, before the units are made: the train ``DataLoader``'s first ``batch_size``
samples, collated, alike on every rank (no worker, no sampler). It runs as ``training_step(batch, 0)`` on a meta
twin (the module's Python state untouched), ``self.log`` silenced, torchmetrics metrics left out, ``.item()``
symbolic, its optimizers stepless and a manual step's ``manual_backward`` keeping the loss (:mod:`.step_stand_ins`);
a step that branches on a value runs again on fake tensors carrying real values (the model's, and the batch's or a
few of its samples': :mod:`.real_values`), else (no real values: a meta model) is measured through ``forward`` on
the batch's first tensor. The global random states (torch, Python, NumPy) are kept: training sees DDP's random
numbers. Batch-transfer hooks are not run.
"""

from __future__ import annotations

import contextlib
import functools
import io
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_vitscale._compat import train_dataloader
from lightning_vitscale.discovery.tensor_plan import TensorPlanError
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.real_values import StepNotMeasuredError, measure_on_real_values
from lightning_vitscale.memory.selective_ops import SelectiveCheckpointingError
from lightning_vitscale.memory.step_inputs import StepInputs
from lightning_vitscale.memory.step_stand_ins import stand_ins
from lightning_vitscale.memory.twin import meta_twin
from lightning_vitscale.precision.library_ops import as_under_autocast, found_ops
from lightning_vitscale.precision.settings import resolve_flag

EXAMPLE_INPUT = "example_input_array"
TRAIN_BATCH = "one batch of the train dataloader"
FIRST_STEP = "the first training batch"


@dataclass(frozen=True)
class PlanningBatch:
    """``value`` fed to ``forward``, or with ``through_training_step`` a batch as ``training_step`` receives it, of
    ``samples``; ``first(k)`` collates its first ``k`` alone (a step run on real values runs a few of them)."""

    value: Any
    source: str
    through_training_step: bool = False
    first: Callable[[int], Any] | None = None
    samples: int = 1


def planning_batch(module: nn.Module, trainer: Any | None) -> PlanningBatch | None:
    """``example_input_array``; else, while fitting (``trainer`` given), the train ``DataLoader``'s first batch."""
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return PlanningBatch(example, EXAMPLE_INPUT)
    if trainer is None:
        return None
    loader = train_dataloader(trainer)
    batch = first_batch(loader)
    if batch is None:
        return None
    samples = min(loader.batch_size, len(loader.dataset))
    return PlanningBatch(batch, TRAIN_BATCH, True, functools.partial(first_batch, loader), samples)


def first_batch(loader: Any, samples: int | None = None) -> Any | None:
    """The first ``batch_size`` (or ``samples``) samples of a ``DataLoader`` over a map-style dataset, collated;
    ``None`` for anything else (an iterable may be consumed by reading it)."""
    dataset = loader.dataset if isinstance(loader, DataLoader) and loader.batch_size else None
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized) or not len(dataset):
        return None
    with random_state_kept():  # random transforms (flips, crops) must not shift the training run's numbers
        return loader.collate_fn([dataset[i] for i in range(min(samples or loader.batch_size, len(dataset)))])


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """torch's (CPU, initialised CUDA devices), Python's and NumPy's global random states restored after the body."""
    import numpy.random  # torchmetrics requires NumPy

    state, numpy_state = random.getstate(), numpy.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state)
        numpy.random.set_state(numpy_state)


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
    """Whether ``module`` defines ``forward`` (a LightningModule's ``training_step`` may call a backbone instead)."""
    forward = getattr(type(module), "forward", None)
    return forward is not None and forward is not nn.Module.forward and (
        not hasattr(module, "training_step") or is_overridden("forward", module))


def training_step_call(model: nn.Module, batch: Any) -> Any:
    """``model.training_step(batch, 0)``'s loss; under manual optimization the losses it gave ``manual_backward``
    (:mod:`.step_stand_ins`: its optimizers stepless). Metrics are left out: their states are plain tensors (not
    buffers) that fake tensors cannot meet, Lightning's most common step updates one (each such module was measured a
    second time through ``forward``), and they keep a few numbers, not activations; a step computing with one falls
    back."""
    metric_class = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    metrics = [m for m in model.modules() if metric_class is not None and isinstance(m, metric_class)]
    nothing = lambda *_, **__: None  # noqa: E731
    losses: list[torch.Tensor] = []
    replaced = [(model, {**dict.fromkeys(("log", "log_dict", "print"), nothing), **stand_ins(model, losses)}),
                *((m, dict.fromkeys(("forward", "update"), nothing)) for m in metrics)]
    with _replaced(replaced):
        out = model.training_step(batch, 0)  # type: ignore[operator]
    if losses:
        return tuple(losses)
    return out.get("loss") if isinstance(out, Mapping) else out


@contextlib.contextmanager
def _replaced(calls: list[tuple[nn.Module, dict[str, Any]]]) -> Iterator[None]:
    """Instance attributes over each module's methods and attributes (on the planner's own twin) for the body, a
    property through its setter (``LightningModule.trainer``); the user's prints silent (a value printed there is
    symbolic: ``zuf0``)."""
    missing = object()

    def current(module: nn.Module, name: str) -> Any:
        if isinstance(getattr(type(module), name, None), property):
            return getattr(module, name)
        return module.__dict__.get(name, missing)

    kept = [(module, name, current(module, name)) for module, values in calls for name in values]
    for module, values in calls:
        for name, value in values.items():
            object.__setattr__(module, name, value)  # not nn.Module's: a stand-in is no submodule or parameter
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for module, name, value in kept:
            if value is missing:
                module.__dict__.pop(name, None)
            else:
                object.__setattr__(module, name, value)


def measure_batch(model: nn.Module, batch: PlanningBatch, **step_kwargs: Any) -> tuple[StepInputs, str]:
    """:func:`~.planner.step_inputs` for ``batch``, and how it was measured (see the module docstring)."""
    how = ""
    policy = resolve_flag(step_kwargs.get("precision", "bf16-mixed"))  # step_inputs' default
    # As the plugin runs a step under the mixed flags: ops with no bf16 kernel as under autocast (torchvision's nms).
    ops = found_ops() if policy.compute != policy.master else ()
    with random_state_kept(), as_under_autocast(ops):  # a training_step's random calls must not shift the run's numbers
        measurable = batch.through_training_step and is_overridden("training_step", model)
        if measurable:
            twin = meta_twin(model)
            try:
                inputs = step_inputs(twin, batch.value, call=training_step_call, **step_kwargs)
                return inputs, f"{batch.source}, through training_step"
            except (TensorPlanError, SelectiveCheckpointingError):
                raise
            except Exception as error:
                # A branch or an index that followed a value (a SymInt index raises IndexError), an op without a
                # fake kernel: real values decide them.
                measured, why = _on_real_values(model, twin, batch, error, step_kwargs)
                if measured is not None:
                    return measured
                if not has_forward(model):
                    if why is error:
                        raise
                    raise why from error
                how = f" (training_step could not run on fake tensors: {_names(why)})"
        value = first_tensor_input(batch.value) if batch.through_training_step else batch.value
        return step_inputs(model, value, **step_kwargs), f"{batch.source}, through forward{how}"


def _on_real_values(model: nn.Module, twin: nn.Module, batch: PlanningBatch, error: Exception,
                    step_kwargs: dict[str, Any]) -> tuple[tuple[StepInputs, str] | None, Exception]:
    """The step measured again on real values (:mod:`.real_values`), or ``None``; and what to report where it was
    not: the fake run's ``error``, with the real run's beside it where that failed too."""
    try:
        measured = measure_on_real_values(model, twin, batch.value, batch.samples, batch.first, training_step_call,
                                          **step_kwargs)
    except Exception as real_error:
        return None, StepNotMeasuredError(f"{briefly(error)}; on real values: {briefly(real_error)}", error,
                                          real_error)
    if measured is None:
        return None, error
    return (measured[0], f"{batch.source}, through training_step, {measured[1]}"), error


def _names(error: Exception) -> str:
    if isinstance(error, StepNotMeasuredError):
        return f"{type(error.fake).__name__}, nor on real values: {type(error.real).__name__}"
    return type(error).__name__


def briefly(error: BaseException) -> str:
    """An error's first line, and where torch says a data-dependent guard came from: its message runs on for ten
    lines of debugging advice, which the setup summary and the fallback's hint would otherwise carry whole."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    caused = next((line.removeprefix("Caused by: ") for line in lines if line.startswith("Caused by:")), None)
    return f"{text} {caused}" if caused else text
