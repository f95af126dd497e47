"""Per-rank memory of one training step under the recipe: what lives when, and the step's predicted peak.

The step is walked phase by phase as FSDP2 runs it: the outer unit gathered from forward to the end of backward
(``reshard_after_forward``'s default for the root), one block gathered (+ its all-gather buffer) in forward,
the current and the prefetched block gathered in backward with the current block's unsharded gradients and
reduce-scatter buffer, activations freed block by block as backward proceeds, sharded gradients growing, and
the optimizer step (foreach AdamW needs one temporary the size of the local parameters). On CPU, gloo's
collectives copy through a temporary the size of the gathered tensor (:func:`collective_copies`): one more block
while a block is gathered, and a block's reduce-scatter holds its input twice (on 2+ ranks). Activations come from
:mod:`lightning_vitscale.memory.activations` (measured on fake tensors); everything else is counted from shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from torch import nn

from lightning_vitscale._utils import shard_rows
from lightning_vitscale.memory.activations import ActivationProfile, BlockMemory

# Optimizer state tensors per parameter, in the parameter's (master) dtype, as torch's optimizers keep them.
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "lion": 1, "sgd-momentum": 1, "sgd": 0, "adagrad": 1}
# Temporaries of one parameter size that the optimizer's step allocates (foreach AdamW: sqrt(v) + denominator).
OPTIMIZER_TEMPORARIES: dict[str, int] = {"adamw": 1, "adam": 1, "lion": 1, "sgd-momentum": 0, "sgd": 0, "adagrad": 1}


@dataclass(frozen=True)
class ModelLayout:
    """Parameter shapes by FSDP unit: what sharding and gathering cost, independent of the batch.

    Attributes:
        blocks: each block's FSDP-managed parameter shapes (norms excluded when they are kept apart).
        outer: the outer unit's parameter shapes.
        norms: shapes of the fp32 norms held replicated outside the units (empty when norms are not separate).
    """

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
        return sum(_numel(s) for unit in [*self.blocks, self.outer, self.norms] for s in unit)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def shard_numel(shapes: list[tuple[int, ...]], world: int) -> int:
    """Elements the fullest rank holds: FSDP2 shards dim 0 and pads it to a multiple of the world size."""
    return sum(shard_rows(s[0] if s else 1, world) * _numel(s[1:]) for s in shapes)


@dataclass(frozen=True)
class StepSettings:
    """The knobs the planner turns: which blocks recompute, and whether blocks stay gathered for backward.

    ``reshard_after_forward=False`` keeps every block gathered; with ``True`` the blocks in ``kept_gathered``
    still keep theirs (a per-unit choice, as ``activation_checkpointing="auto"`` makes it).
    """

    checkpointed: frozenset[int] = frozenset()
    reshard_after_forward: bool = True
    offload: bool = False
    selective: frozenset[int] = frozenset()  # of ``checkpointed``: those checkpointed selectively (op-level)
    kept_gathered: frozenset[int] = frozenset()  # blocks that keep their gathered parameters for backward

    def keeps(self, index: int) -> bool:
        """Whether block ``index`` stays gathered from its forward to its backward."""
        return not self.reshard_after_forward or index in self.kept_gathered


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
    """When the sharded gradients are alive, as the training loop orders ``zero_grad``, forward and backward.

    Lightning's automatic optimization runs ``training_step`` (the forward), *then* ``zero_grad``, then
    ``backward``: the previous step's gradient shards live through the forward unless the strategy released them
    after the optimizer step (``released_after_step``, see ``VitScaleStrategy.optimizer_step``). Manual
    optimization is planned for the order Lightning documents (``zero_grad``, forward, ``manual_backward``,
    ``step``). With gradient accumulation every micro-batch after the first runs forward and backward with the
    full gradient shards alive, and so does ``zero_grad(set_to_none=False)`` (gradients are zeroed, never freed).

    Attributes:
        automatic: ``LightningModule.automatic_optimization``.
        accumulate: ``Trainer(accumulate_grad_batches=...)``.
        set_to_none: whether ``zero_grad`` frees the gradients (torch's and Lightning's default).
        released_after_step: the strategy frees the gradient shards right after the optimizer step.
    """

    automatic: bool = True
    accumulate: int = 1
    set_to_none: bool = True
    released_after_step: bool = False

    @property
    def grads_in_forward(self) -> bool:
        """Whether all gradient shards are alive while the forward runs (some micro-batch's forward)."""
        return self.grads_in_backward or (self.automatic and not self.released_after_step)

    @property
    def grads_in_backward(self) -> bool:
        """Whether all gradient shards are alive from the start of backward (else they grow block by block)."""
        return self.accumulate > 1 or not self.set_to_none


# The order a hand-written loop (and Lightning's manual optimization as documented) runs: zero_grad first.
ZERO_GRAD_FIRST = TrainingLoop(automatic=False)


@dataclass(frozen=True)
class StepInputs:
    """Everything the step model needs besides the settings."""

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


def collective_copies(device: torch.device | str | None) -> bool:
    """Whether the process group on ``device`` copies each all-gather / reduce-scatter through a temporary.

    gloo (CPU) does: torch's profiler (allocator events, 1/2/4 ranks, fp32 and bf16, sync and async) shows
    ``all_gather_into_tensor`` allocating one temporary the size of the gathered output (twice in a row, never
    both live) and ``reduce_scatter_tensor`` one the size of its unsharded input, freed when the call returns.
    NCCL reads and writes FSDP's own buffers in place, so CUDA devices (and an unknown device) get none.
    """
    return device is not None and torch.device(device).type == "cpu"


def predict_step(inputs: StepInputs, settings: StepSettings) -> MemoryBreakdown:
    """The peak of one steady-state step (optimizer state exists; gradients alive as ``inputs.loop`` orders)."""
    return max(step_phases(inputs, settings), key=lambda b: b.peak)


def step_phases(inputs: StepInputs, settings: StepSettings) -> list[MemoryBreakdown]:
    """Each phase's memory: end of forward, the backward of each block (last first), the optimizer step."""
    lay, prof, scale = inputs.layout, inputs.profile, inputs.batch_scale
    m, c, r = inputs.master.itemsize, inputs.compute.itemsize, inputs.reduce.itemsize
    states = OPTIMIZER_STATES[inputs.optimizer]
    shards = [shard_numel(b, inputs.world) for b in lay.blocks]
    outer_shard = shard_numel(lay.outer, inputs.world)
    params = (sum(shards) + outer_shard) * m
    on_device = 0 if settings.offload else 1  # offloaded state lives in host memory, not on the device
    norm_numel = sum(_numel(s) for s in lay.norms)
    norms = norm_numel * 4 * (2 + states)
    full_blocks = [sum(_numel(s) for s in b) for b in lay.blocks]
    outer_full = sum(_numel(s) for s in lay.outer) * c
    kept = [int(_kept(b, i, settings) * scale) for i, b in enumerate(prof.blocks)]
    batch = int(prof.batch_bytes * scale)
    base = dict(params=params * on_device, optimizer=params * states * on_device, norms=norms, batch=batch)
    return [
        _forward_peak(inputs, settings, base, full_blocks, outer_full, kept),
        *_backward_peaks(inputs, settings, base, full_blocks, shards, outer_full, kept, c, r, m, on_device),
        MemoryBreakdown(grads=params * on_device, gathered=0, activations=0,
                        transient=params * OPTIMIZER_TEMPORARIES[inputs.optimizer] * on_device,
                        phase="optimizer step", **base),
    ]


def _kept(block: BlockMemory, index: int, settings: StepSettings) -> int:
    """What a block keeps from forward to backward: everything saved, its input (full checkpointing), or its
    input and the expensive ops' outputs (selective)."""
    if index in settings.selective:
        return block.selective_saved
    return block.input if index in settings.checkpointed else block.saved


def _inside(block: BlockMemory, index: int, settings: StepSettings) -> int:
    """What a block's backward allocates beyond what it kept (a full recompute starts from its input alone)."""
    if index in settings.selective:
        return block.selective_backward
    return block.recompute - block.input if index in settings.checkpointed else block.backward


def _forward_peak(inputs, settings, base, full_blocks, outer_full, kept) -> MemoryBreakdown:
    c = inputs.compute.itemsize
    biggest = max(full_blocks, default=0) * c
    copy = biggest if inputs.collective_copies else 0  # gloo's temporary while a block is gathered
    # Blocks that stay gathered for backward pile up; besides them one block and its all-gather buffer.
    kept_bytes = sum(f for i, f in enumerate(full_blocks) if settings.keeps(i)) * c
    every_kept = all(settings.keeps(i) for i in range(len(full_blocks)))
    gathered = outer_full + kept_bytes + (biggest if every_kept else 2 * biggest)
    acts = int(inputs.profile.outer_saved * inputs.batch_scale) + sum(kept)
    grads = base["params"] if inputs.loop.grads_in_forward else 0  # sharded gradients: as many as parameters
    return MemoryBreakdown(grads=grads, gathered=gathered, activations=acts, transient=copy, phase="end of forward",
                           **base)


def _backward_peaks(inputs, settings, base, full_blocks, shards, outer_full, kept, c, r, m, on_device):
    prof, scale = inputs.profile, inputs.batch_scale
    outer_acts = int(prof.outer_saved * scale)
    outer_grads = int(prof.outer_backward * scale)
    n = len(full_blocks)
    # Running sums (the planner's search predicts thousands of plans): blocks 0..i's kept gathered parameters and
    # kept activations, blocks i+1..'s gradient shards.
    kept_gathered = list(accumulate(f if settings.keeps(j) else 0 for j, f in enumerate(full_blocks)))
    kept_acts = list(accumulate(kept))
    later_shards = [*reversed(list(accumulate(reversed(shards[1:])))), 0]
    for i in reversed(range(n)):
        # Blocks up to i that stayed gathered, plus block i and the prefetched block i-1 if they resharded.
        resharded = sum(full_blocks[j] for j in (i, i - 1) if j >= 0 and not settings.keeps(j))
        gathered = outer_full + (kept_gathered[i] + resharded) * c
        block = prof.blocks[i]
        # A checkpointed block holds its input (in `kept`), then recomputes and runs its backward.
        inside = _inside(block, i, settings)
        compute = int(inside * scale)  # includes the block's unsharded parameter gradients
        if i in settings.checkpointed and i not in settings.selective and not settings.keeps(i):
            # Measured `Trainer.fit` steps (benchmarks/RESULTS.md, "against Trainer.fit") hold one more block of
            # gradient size while a fully checkpointed block recomputes and runs its backward than the fake-tensor
            # run of that block alone shows (7-12% of the step's increment without it, on DeiT-Tiny and ViT-S;
            # selective blocks were 4-9% over with it). Not where the block stayed gathered (no all-gather in
            # its backward): DeiT-Tiny's auto cell with kept, fully checkpointed blocks is 14% over with it.
            compute += full_blocks[i] * r
        # FSDP copies the block's unsharded gradients into the reduce-scatter input (both live for the copy-in);
        # gloo then holds that input and its own copy of it (the gradients are freed after the copy-in). The
        # backward compute's transients are gone by then. FSDP copies instead of reduce-scattering on one rank.
        collective = full_blocks[i] * (c + r)
        if inputs.collective_copies and inputs.world > 1:
            collective = max(collective, 2 * full_blocks[i] * r)
        transient = max(compute, collective) + outer_grads
        yield MemoryBreakdown(
            grads=base["params"] if inputs.loop.grads_in_backward else later_shards[i] * m * on_device,
            gathered=gathered,
            activations=outer_acts + kept_acts[i],
            transient=transient,
            phase=f"backward of block {i}",
            **base,
        )
