"""What each step of the parallelize pipeline did (``steps.py``), recorded as frozen dataclasses: the setup summary
is built from them (``summary.summary_from_facts``) and the setup's later phases read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale.discovery.blocks import Named
from lightning_vitscale.kernels import AttentionRouter, KernelPolicy
from lightning_vitscale.precision import ReplicatedNorms
from lightning_vitscale.sharding.activation_checkpointing import CheckpointMode


@dataclass(frozen=True)
class NormFacts:
    """The norms kept in fp32 outside the low-precision units (``modules``), replicated as ``replicated``, which
    also holds the 0-dim parameters (``scalars``, their names: ``scalar_parameters.py``)."""

    modules: Named
    replicated: ReplicatedNorms | None
    scalars: list[str] = field(default_factory=list)

    @property
    def ignored(self) -> set[nn.Parameter] | None:
        return self.replicated.ignored() if self.replicated else None


@dataclass(frozen=True)
class CheckpointFacts:
    """Blocks checkpointed, each with its mode (model order), and those left alone as they checkpoint themselves."""

    modes: dict[str, CheckpointMode]
    self_checkpointed: list[str]


@dataclass(frozen=True)
class CompileFacts:
    """Compiled in place: one class name per block, the outer sub-modules' names (``None``: ``compile_outer`` off)."""

    block_classes: list[str]
    outer: list[str] | None


@dataclass(frozen=True)
class UnitFacts:
    """The FSDP units made: the outer unit, then the block units."""

    outer: FSDPModule
    block_units: list[FSDPModule]
    blocks_per_unit: int
    copies: bool = False
    """One rank, one unit: compute copies instead of FSDP2's per-parameter path (sharding/compute_copies.py)."""
    tied: int = 0
    """Blocks left in the outer unit because a weight of theirs is tied to another unit's or the model's."""
    skippable: int = 0
    """Blocks left in the outer unit because ``find_unused_parameters=True`` lets ranks skip them."""
    alone: int = 0
    """Blocks left in the outer unit under ``find_unused_parameters="units"``: no member of a stack
    (``stand_ins.not_in_a_stack``)."""
    members: tuple[tuple[nn.Module, ...], ...] = ()
    """Each block unit's modules (``block_units``' order): what a measured step's call order places."""

    @property
    def all(self) -> list[FSDPModule]:
        return [self.outer, *self.block_units]


@dataclass(frozen=True)
class TensorParallelFacts:
    """Per block class its plan, what stays whole and the proof; the packed projections."""

    size: int
    plans: dict[str, str]
    interleaved: list[str]


@dataclass(frozen=True)
class InitFacts:
    """How the starting weights were made, the host-memory peak growth, seconds, and inits not reproduced."""

    path: str
    peak_bytes: int
    seconds: float
    not_reproduced: list[str]


@dataclass(frozen=True)
class PipelineFacts:
    """Everything the steps did, for :func:`~lightning_vitscale.sharding.summary.summary_from_facts`."""

    world_size: int
    model_class: str
    blocks: list[str]
    described: dict[str, int]
    norms: NormFacts
    checkpointing: CheckpointFacts
    compiled: CompileFacts
    router: AttentionRouter | None
    kernels: KernelPolicy
    tensor_core_misses: list[str]
    units: UnitFacts
    overlap: str
    init: InitFacts
    params: list[nn.Parameter]
    precision: str
    tensor: TensorParallelFacts | None = None
    joined: dict[str, list[str]] = field(default_factory=dict)
    """Found blocks never called themselves -> the classes of their modules that run, one unit together."""
    made_contiguous: list[str] = field(default_factory=list)
    """Parameters that were not contiguous (channels_last), made so for FSDP."""
    reused: list[tuple[str, str, int]] = field(default_factory=list)
    """No repeated blocks found: the modules a step ran several times each (name, class, calls per step)."""

