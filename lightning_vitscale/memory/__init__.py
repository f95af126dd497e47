"""Memory: per-rank state bytes, activations measured on fake tensors, the per-step memory and time models, the
planner (``plan_memory`` -> :class:`MemoryPlan`) and its one search (checkpointing, units kept gathered, blocks per
unit), and ``accumulation="auto"``'s choice.

Predicts and chooses, never changes a model: may import ``discovery``, ``precision`` (dtype policies), ``_utils``
and ``_compat``; the sharding setup applies what it chooses.
"""

from lightning_vitscale.memory.accumulation import (
    ACCUMULATION_MODES,
    AccumulationChoice,
    AccumulationMode,
    choose_accumulation,
)
from lightning_vitscale.memory.activations import ModeOf
from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing, describe_prediction, device_memory
from lightning_vitscale.memory.budget import check_budget, resolve_budget
from lightning_vitscale.memory.gradient_release import may_release_after_step, release_gradients
from lightning_vitscale.memory.measurement import Measurement
from lightning_vitscale.memory.memory_plan import MemoryPlan
from lightning_vitscale.memory.planner import batch_size_of, plan_memory
from lightning_vitscale.memory.planning_batch import PlanningBatch, planning_batch
from lightning_vitscale.memory.selective_ops import (
    SelectiveCheckpointingError,
    refuse_selective_calling_blocks,
    selective_contexts,
)
from lightning_vitscale.memory.state_bytes import StateBytes, measure_state_bytes
from lightning_vitscale.memory.step_cost import compile_pays, rates_for
from lightning_vitscale.memory.step_inputs import StepInputs, StepSettings

__all__ = [
    "ACCUMULATION_MODES",
    "AccumulationChoice",
    "AccumulationMode",
    "AutoCheckpointing",
    "Measurement",
    "MemoryPlan",
    "ModeOf",
    "PlanningBatch",
    "SelectiveCheckpointingError",
    "StateBytes",
    "StepInputs",
    "StepSettings",
    "batch_size_of",
    "check_budget",
    "compile_pays",
    "choose_accumulation",
    "describe_prediction",
    "device_memory",
    "may_release_after_step",
    "measure_state_bytes",
    "plan_memory",
    "planning_batch",
    "rates_for",
    "refuse_selective_calling_blocks",
    "release_gradients",
    "resolve_budget",
    "selective_contexts",
]
