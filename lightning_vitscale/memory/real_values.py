"""A step that fake tensors alone cannot run (a detector's random resize, box matching and NMS branch on values; a
DETR loss matches boxes with SciPy; an index taken from a label), measured again on fake tensors that carry real
ones: the step computes for real on the host beside the fake run, each branch goes the way the real values take it,
``.numpy()`` gives the real values (:mod:`.fake_modes`).

Real values cost what fake tensors never do: a host copy of the model (at most
:data:`~.twin.REAL_VALUES_LIMIT`) and real compute and activations. So a batch of more than five samples is not run
whole: its first two and first three samples are, and each measured number is extrapolated along the line through
them to the batch (activations grow with the samples, a block's weight gradients do not: scaling one sample's numbers
by a batch of 4 over-predicted torchvision detectors' peaks by up to 48%). Two, not one: a BatchNorm after global
pooling refuses a batch of one in training. Up to five samples the batch runs whole, once: two and three would cost as
many samples in two runs, each with its own per-op cost of fake tensors (a Faster R-CNN at a batch of 4: 23 s of
planning in two runs, 10 s whole).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_vitscale.memory.activations import StepCall
from lightning_vitscale.memory.fake_modes import UnlikeRecords, map_records
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_inputs import StepInputs
from lightning_vitscale.memory.twin import real_values

SMALL_BATCH = 5
"""A batch of at most this many samples is run whole on real values (its first 2 and 3 would cost as many samples,
in two runs); a larger one on its first 2 and 3 samples."""


def measure_on_real_values(
    model: nn.Module, twin: nn.Module, batch: Any, samples: int, first: Callable[[int], Any] | None, call: StepCall,
    **step_kwargs: Any,
) -> tuple[StepInputs, str] | None:
    """``twin`` (``model``'s meta twin) measured through ``call`` with ``model``'s real values, on ``batch`` of
    ``samples`` (``first(k)``: its first ``k`` samples collated, ``None``: run it whole); ``None`` where no real
    values exist (meta, sharded, too large, a tensor-parallel share); raises what the run raised where it fails too.
    Also: how it was measured."""
    values = real_values(twin, model)
    if values is None or step_kwargs.get("tensor_parallel", 1) > 1:
        return None
    if first is None or samples <= SMALL_BATCH:
        return step_inputs(twin, batch, call=call, values=values, **step_kwargs), "with real values"
    two = step_inputs(twin, first(2), call=call, values=values, **step_kwargs)
    three = step_inputs(twin, first(3), call=call, values=values, **step_kwargs)
    how = f"with real values on its first 2 and 3 samples, extrapolated to {samples}"
    try:
        return dataclasses.replace(three, profile=extrapolated(two.profile, three.profile, samples - 3)), how
    except UnlikeRecords:  # the two runs measured different blocks (a branch took another path): scaled from the larger
        return dataclasses.replace(three, batch_scale=samples / 3), "with real values on its first 3 samples, scaled"


def extrapolated(smaller: Any, larger: Any, steps: int) -> Any:
    """Each number of ``larger`` (a measurement of one sample more than ``smaller``) carried ``steps`` samples further
    along the line through the two (never below 0); anything else as ``larger`` has it, and equal in both
    (``UnlikeRecords`` otherwise)."""
    def leaf(value: Any, before: Any) -> Any:
        if type(value) in (int, float):
            return max(type(value)(0), value + (value - before) * steps)
        if value != before:
            raise UnlikeRecords(f"{before!r} against {value!r}")
        return value

    return map_records(leaf, larger, smaller)


class StepNotMeasuredError(RuntimeError):
    """A step that failed on fake tensors and again on real values: both errors, briefly, in its first line."""

    def __init__(self, message: str, fake: Exception, real: Exception) -> None:
        super().__init__(message)
        self.fake, self.real = fake, real
