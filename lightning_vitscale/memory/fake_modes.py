"""The fake tensor modes the planner measures in: plain fake tensors (shapes, no memory), or fake tensors that carry
real values (torch's ``fake_tensor_propagate_real_tensors``, export's draft mode), for a step whose branches, indices
or shapes follow its values (:mod:`.real_values`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from lightning_vitscale._compat import (
    FakeTensorMode,
    ShapeEnv,
    op_mutates,
    propagating_real_tensors,
    real_numpy,
)
from lightning_vitscale.memory.local_collectives import COLLECTIVE_NAMESPACES, answered_locally
from lightning_vitscale.memory.op_costs import tensors_of

_CPU = torch.device("cpu")

RealValues = Mapping[int, torch.Tensor]
"""Real values of a model's parameters and buffers, by ``id`` of the tensor in the measured model (its meta twin's):
fake tensors then carry them and a step branching on a value runs."""


class FakeMode(FakeTensorMode):
    """``FakeTensorMode`` whose collectives stay on the rank (:mod:`.local_collectives`: the planner measures the
    step on one rank), and that asks once whether a GPU may be initialised: under Lightning's
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` each ``torch.cuda.is_available()`` loads NVML, and it asked on every op
    (~8% of the planner's CPU time in a profile of the test suite)."""

    @functools.cached_property
    def avoid_device_init(self) -> bool:  # type: ignore[override]
        return bool(FakeTensorMode.avoid_device_init.fget(self))  # type: ignore[attr-defined]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace in COLLECTIVE_NAMESPACES:
            run = lambda op, *a, **k: FakeTensorMode.__torch_dispatch__(self, op, types, a, k)  # noqa: E731
            return answered_locally(func, args, kwargs or {}, run)
        return super().__torch_dispatch__(func, types, args, kwargs)


class RealValuedMode(FakeMode):
    """Fake tensors carrying real values. A real result laid out otherwise than its fake one (CPU's GroupNorm keeps a
    channels-last input's layout, its fake kernel does not: ViTDet's pyramid in examples/detection.py) is copied into
    the fake one's layout: a view of it (``target[i, label]``) then sits at the offset the fake view has, which
    torch checks."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not func.is_view and not op_mutates(func):
            for fake in tensors_of(out):
                _lay_out_as_fake(fake)
        return out


def _lay_out_as_fake(fake: torch.Tensor) -> None:
    real = getattr(fake, "real_tensor", None)
    if real is None or real.shape != fake.shape or not all(type(s) is int for s in fake.stride()):
        return
    if real.stride() != fake.stride():
        laid = torch.empty_strided(real.shape, fake.stride(), dtype=real.dtype, device=real.device)
        fake.real_tensor = laid.copy_(real)  # type: ignore[attr-defined]


def fake_mode(symbolic_items: bool, values: RealValues | None) -> FakeTensorMode:
    """Through a custom call (a training_step) a ``.item()`` (a loss appended to a list) gives a symbolic number
    instead of failing; branching on it fails unless the fake tensors carry ``values``. A plain tensor attribute
    (neither parameter nor buffer: HF VideoMAE's position table) stays real; an op meeting it takes it as a constant
    instead of failing the measurement."""
    if values is None:
        return FakeMode(shape_env=ShapeEnv() if symbolic_items else None, allow_non_fake_inputs=True)
    # Under `carrying_real_values`. Static shapes: only what follows a value is symbolic, resolved by it.
    return RealValuedMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True, static_shapes=True)


def fake_batch_tensor(value: torch.Tensor, dtype: torch.dtype, mode: FakeTensorMode, real: bool) -> torch.Tensor:
    """One batch tensor as the step meets it: in the compute dtype, fake, carrying its value where ``real``."""
    if real:
        return mode.from_tensor(value.detach().to(device=_CPU, dtype=dtype))
    with mode:
        return torch.empty(value.shape, dtype=dtype, device=_CPU)


@contextlib.contextmanager
def carrying_real_values(on: bool) -> Iterator[None]:
    """Fake tensors made and run in the body carry real values (:func:`propagating_real_tensors`), and torch's warning
    at each branch a real value decided is silenced (meant for export, where such a guard is a finding; here it is
    the reason the values are carried)."""
    if not on:
        yield
        return
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with propagating_real_tensors(), real_numpy():
            yield
    finally:
        logger.setLevel(level)


def on_host(real: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``real`` as the step meets it, on the host (zeros where no value is known: never uninitialised memory)."""
    if real is None:
        return torch.zeros(like.shape, dtype=dtype)
    return real.detach().to(device=_CPU, dtype=dtype)


def concrete(value: Any) -> Any:
    """``value`` with each symbolic number (a size that followed a value, on fake tensors carrying real ones) made the
    number the real values gave: the planner's arithmetic after the measurement is on plain ints."""
    numbers = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}
    return map_records(lambda leaf: numbers[type(leaf)](leaf) if type(leaf) in numbers else leaf, value)


class UnlikeRecords(ValueError):
    """Records of different structure (other blocks, calls or keys) where alike ones were expected."""


def map_records(leaf: Callable[..., Any], record: Any, *alike: Any) -> Any:
    """``record`` (dataclasses, lists, tuples and dicts of numbers, a measurement) rebuilt with ``leaf`` applied to
    each of its leaves and the same leaf of each ``alike`` record, which must have its structure (``UnlikeRecords``)."""
    if any(type(other) is not type(record) for other in alike):
        raise UnlikeRecords(f"{type(record).__name__} against {[type(other).__name__ for other in alike]}")
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return dataclasses.replace(record, **{  # type: ignore[misc]
            f.name: map_records(leaf, getattr(record, f.name), *(getattr(other, f.name) for other in alike))
            for f in dataclasses.fields(record) if f.init})
    if type(record) in (list, tuple):
        if any(len(other) != len(record) for other in alike):
            raise UnlikeRecords("another length")
        return type(record)(map_records(leaf, *values) for values in zip(record, *alike))
    if type(record) is dict:
        if any(other.keys() != record.keys() for other in alike):
            raise UnlikeRecords("other keys")
        return {key: map_records(leaf, value, *(other[key] for other in alike)) for key, value in record.items()}
    return leaf(record, *alike)
