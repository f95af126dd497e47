"""What the step model reads and returns: the model's parameter layout, the planner's knobs (:class:`StepSettings`),
the loop's gradient lifetimes (:class:`TrainingLoop`), the measured profile with the dtypes and world
(:class:`StepInputs`), and the per-kind bytes at the peak (:class:`MemoryBreakdown`). The arithmetic is
:mod:`.step_model`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_vitscale.discovery.unit_runs import UnitRuns, spans_of
from lightning_vitscale.memory.activations import ActivationProfile
from lightning_vitscale.memory.tensor_split import TensorSplit

# Optimizer state tensors per parameter (master dtype), and the temporaries its step allocates (foreach AdamW:
# sqrt(v) + denominator).
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "lion": 1, "sgd-momentum": 1, "sgd": 0, "adagrad": 1}
OPTIMIZER_TEMPORARIES: dict[str, int] = {"adamw": 1, "adam": 1, "lion": 1, "sgd-momentum": 0, "sgd": 0, "adagrad": 1}


@dataclass(frozen=True)
class ModelLayout:
    """Parameter shapes per block, of the outer unit and of the fp32 norms kept replicated outside the units."""

    blocks: list[list[tuple[int, ...]]]
    outer: list[tuple[int, ...]]
    norms: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module, blocks: list[nn.Module], norms: list[nn.Module]) -> ModelLayout:
        norm_params = {id(p) for m in norms for p in m.parameters(recurse=False)}
        in_block = {id(p) for b in blocks for p in b.parameters()}
        return cls(
            blocks=[[tuple(p.shape) for p in b.parameters() if id(p) not in norm_params] for b in blocks],
            outer=[tuple(p.shape) for p in model.parameters() if id(p) not in in_block | norm_params],
            norms=[tuple(p.shape) for m in norms for p in m.parameters(recurse=False)],
        )

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for unit in [*self.blocks, self.outer, self.norms] for s in unit)


@dataclass(frozen=True)
class StepSettings:
    """The knobs the planner turns. ``reshard_after_forward=False`` keeps every block gathered; with ``True`` the
    blocks in ``kept_gathered`` keep their parameters (every block of a unit: the unit keeps, or none). Up to
    ``blocks_per_unit`` consecutive blocks share one FSDP unit (:func:`unit_spans`): gathered together, their
    unsharded gradients wait for one reduce-scatter."""

    checkpointed: frozenset[int] = frozenset()
    reshard_after_forward: bool = True
    offload: bool = False
    selective: frozenset[int] = frozenset()  # of ``checkpointed``: those checkpointed selectively (op-level)
    kept_gathered: frozenset[int] = frozenset()  # blocks that keep their gathered parameters for backward
    blocks_per_unit: int = 1

    def keeps(self, index: int) -> bool:
        """Whether block ``index`` (its unit) stays gathered from its forward to its backward."""
        return not self.reshard_after_forward or index in self.kept_gathered

    def keeps_all(self, n: int) -> bool:
        return not self.reshard_after_forward or len(self.kept_gathered) >= n


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the step's peak, by kind; ``peak`` is their sum and ``phase`` says when it occurs."""

    params: int
    grads: int
    optimizer: int
    norms: int
    gathered: int
    activations: int
    transient: int
    batch: int
    phase: str

    @property
    def peak(self) -> int:
        return (self.params + self.grads + self.optimizer + self.norms + self.gathered + self.activations
                + self.transient + self.batch)


@dataclass(frozen=True)
class TrainingLoop:
    """When the sharded gradients are alive, as the loop orders ``zero_grad``, forward and backward.

    Lightning's automatic optimization runs the forward *before* ``zero_grad``: the last step's gradient shards live
    through it unless the strategy ``released_after_step`` (:mod:`.gradient_release`). Manual optimization is
    planned for the order Lightning documents (``zero_grad`` first). With ``accumulate > 1`` or
    ``zero_grad(set_to_none=False)`` every shard is alive through forward and backward.
    """

    automatic: bool = True
    accumulate: int = 1
    set_to_none: bool = True
    released_after_step: bool = False

    @property
    def grads_in_forward(self) -> bool:
        return self.grads_in_backward or (self.automatic and not self.released_after_step)

    @property
    def grads_in_backward(self) -> bool:
        """Whether all gradient shards are alive from the start of backward (else they grow unit by unit)."""
        return self.accumulate > 1 or not self.set_to_none


@dataclass(frozen=True)
class StepInputs:
    """Everything the step model needs besides the settings. ``world``: one FSDP shard group; with ``tensor`` the
    layout and activations are one tensor-parallel rank's share (:mod:`.tensor_split`)."""

    layout: ModelLayout
    profile: ActivationProfile
    world: int
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    optimizer: str = "adamw"
    batch_scale: float = 1.0
    collective_copies: bool = False
    loop: TrainingLoop = TrainingLoop()
    replicas: int = 1  # hybrid sharding's copies of the shard group: their all-reduce
    tensor: TensorSplit | None = None
    runs: UnitRuns | None = None  # which blocks may share a unit, as setup finds them (``None``: any consecutive)


def unit_spans(inputs: StepInputs, settings: StepSettings) -> tuple[range, ...]:
    """The block indices of each FSDP unit, as setup makes them (``sharding.steps.apply_fsdp``): ``inputs.runs``'
    spans of up to ``blocks_per_unit`` blocks; without their sharing keys where one rank keeps every block (setup
    then ignores them: one unit, which joins the outer one, ``computes_on_copies``)."""
    n, per_unit = len(inputs.layout.blocks), settings.blocks_per_unit
    if inputs.runs is None:
        return tuple(spans_of(n, per_unit))
    alone = inputs.world == 1 and inputs.replicas == 1 and inputs.tensor is None and settings.keeps_all(n)
    return inputs.runs.spans(per_unit, sharing=not alone)


def collective_copies(device: torch.device | str | None) -> bool:
    """Whether the process group on ``device`` copies each all-gather / reduce-scatter through a temporary: gloo
    (CPU) does (the profiler's allocator events: one of the gathered output's size, one of the unsharded input's),
    NCCL works in FSDP's buffers in place."""
    return device is not None and torch.device(device).type == "cpu"
