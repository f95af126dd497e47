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

from lightning_vitscale._utils import shard_numel
from lightning_vitscale.memory.activations import ActivationProfile, BlockMemory
from lightning_vitscale.memory.tensor_split import TensorSplit

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


@dataclass(frozen=True)
class StepSettings:
    """The knobs the planner turns: which blocks recompute, and whether blocks stay gathered for backward.

    ``reshard_after_forward=False`` keeps every block gathered; with ``True`` the blocks in ``kept_gathered``
    still keep theirs (a per-unit choice, as ``activation_checkpointing="auto"`` makes it). ``blocks_per_unit``
    consecutive blocks share one FSDP unit (``VitScaleStrategy(blocks_per_unit=...)``): they are gathered together,
    and their unsharded gradients wait for one reduce-scatter after the last of their backwards. Reshard is a
    unit's setting: a unit keeps its parameters when its first block is in ``kept_gathered``.
    """

    checkpointed: frozenset[int] = frozenset()
    reshard_after_forward: bool = True
    offload: bool = False
    selective: frozenset[int] = frozenset()  # of ``checkpointed``: those checkpointed selectively (op-level)
    kept_gathered: frozenset[int] = frozenset()  # blocks that keep their gathered parameters for backward
    blocks_per_unit: int = 1

    def keeps(self, index: int) -> bool:
        """Whether block ``index`` (its unit) stays gathered from its forward to its backward."""
        first = index - index % self.blocks_per_unit
        return not self.reshard_after_forward or first in self.kept_gathered


def unit_spans(n: int, per_unit: int) -> list[range]:
    """The block indices of each FSDP unit: consecutive runs of ``per_unit`` (the last may be shorter), as
    ``sharding.fsdp.group_blocks`` groups them."""
    return [range(start, min(start + per_unit, n)) for start in range(0, n, per_unit)]


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
    """Everything the step model needs besides the settings.

    ``world`` is one FSDP shard group (the data-parallel ranks under tensor parallelism); with ``tensor`` the
    layout and the activations were measured on one tensor-parallel rank's split twin (:mod:`.tensor_split`), so
    everything below counts that rank's share, and ``tensor`` holds its all-reduces.
    """

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
    replicas: int = 1  # hybrid sharding's replica groups (``world`` is then one shard group): their all-reduce
    tensor: TensorSplit | None = None  # tensor_parallel=k: layout and profile are one TP rank's (a split twin's)


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
        *_forward_phases(inputs, settings, base, full_blocks, outer_full, kept),
        *_backward_peaks(inputs, settings, base, full_blocks, shards, outer_full, kept, c, r, m, on_device),
        MemoryBreakdown(grads=params * on_device, gathered=0, activations=0,
                        transient=params * OPTIMIZER_TEMPORARIES[inputs.optimizer] * on_device,
                        phase="optimizer step", **base),
    ]


def _kept(block: BlockMemory, index: int, settings: StepSettings) -> int:
    """What a block keeps from forward to backward: everything saved, its input (full checkpointing), or its
    input and the expensive ops' outputs (selective)."""
    mode = _measured_mode(block, index, settings)
    if mode == "selective":
        return block.selective_saved
    return block.input if mode == "full" else block.saved


def _inside(block: BlockMemory, index: int, settings: StepSettings) -> int:
    """What a block's backward allocates beyond what it kept (a full recompute starts from its input alone)."""
    mode = _measured_mode(block, index, settings)
    if mode == "selective":
        return block.selective_backward
    return block.recompute - block.input if mode == "full" else block.backward


def _measured_mode(block: BlockMemory, index: int, settings: StepSettings) -> str:
    mode = "selective" if index in settings.selective else "full" if index in settings.checkpointed else "none"
    if mode not in block.modes:
        raise ValueError(f"{block.name} was measured for {sorted(block.modes)} only, not {mode!r}: measure it with"
                         " mode_of=None to predict other checkpointing.")
    return mode


def _forward_phases(inputs, settings, base, full_blocks, outer_full, kept) -> list[MemoryBreakdown]:
    """Each unit's all-gather and the end of its forward, the last one's being the end of the forward.

    While a unit is gathered, its all-gather output and one more unit-sized tensor are alive: gloo's temporary
    during the collective, then the unsharded parameters FSDP copies out into (the output is freed after that).
    At the end of a unit's forward, its parameters are still gathered, with every activation saved so far.
    Units that stay gathered for backward pile up.
    """
    c, scale = inputs.compute.itemsize, inputs.batch_scale
    spans = unit_spans(len(full_blocks), settings.blocks_per_unit)
    grads = base["params"] if inputs.loop.grads_in_forward else 0  # sharded gradients: as many as parameters
    # The outer layers after the blocks (head, final norm) save theirs only at the end of the forward.
    outer_acts = int((inputs.profile.outer_saved - inputs.profile.outer_saved_after) * scale)
    outer_end = int(inputs.profile.outer_saved * scale)
    phases, kept_before, acts_before = [], 0, 0
    for u, span in enumerate(spans):
        unit = sum(full_blocks[i] for i in span) * c
        gathered = outer_full + kept_before + unit
        acts_after = acts_before + sum(kept[i] for i in span)
        last = u == len(spans) - 1
        phases += [
            MemoryBreakdown(grads=grads, gathered=gathered, activations=outer_acts + acts_before, transient=unit,
                            phase=f"all-gather of unit {u}", **base),
            MemoryBreakdown(grads=grads, gathered=gathered, activations=(outer_end if last else outer_acts)
                            + acts_after, transient=0,
                            phase="end of forward" if last else f"end of unit {u}'s forward", **base),
        ]
        kept_before += unit if settings.keeps(span[0]) else 0
        acts_before = acts_after
    if not spans:
        phases.append(MemoryBreakdown(grads=grads, gathered=outer_full, activations=outer_end, transient=0,
                                      phase="end of forward", **base))
    return phases


def _backward_peaks(inputs, settings, base, full_blocks, shards, outer_full, kept, c, r, m, on_device):
    prof, scale = inputs.profile, inputs.batch_scale
    # The head's and final norm's saved tensors are freed by their backward, before any block's.
    outer_acts = int((prof.outer_saved - prof.outer_saved_after) * scale)
    outer_grads = int(prof.outer_backward * scale)
    n = len(full_blocks)
    # Running sums (the planner's search predicts thousands of plans): blocks 0..i's kept gathered parameters and
    # kept activations, blocks i+1..'s gradient shards.
    kept_gathered = list(accumulate(f if settings.keeps(j) else 0 for j, f in enumerate(full_blocks)))
    kept_acts = list(accumulate(kept))
    later_shards = [*reversed(list(accumulate(reversed(shards[1:])))), 0]
    spans = unit_spans(n, settings.blocks_per_unit)
    unit_fulls = [sum(full_blocks[j] for j in span) for span in spans]
    for u in reversed(range(len(spans))):
        span, unit_full = spans[u], unit_fulls[u]
        # Units up to this one that stayed gathered, plus this unit and the prefetched previous one if they
        # resharded (a unit stays gathered until its last block's backward is done).
        resharded = sum(unit_fulls[v] for v in (u, u - 1) if v >= 0 and not settings.keeps(spans[v][0]))
        gathered = outer_full + (kept_gathered[span[-1]] + resharded) * c
        # FSDP copies the unit's unsharded gradients into the reduce-scatter input (both live for the copy-in);
        # gloo then holds that input and its own copy of it (the gradients are freed after the copy-in). That is
        # after the unit's first block's backward: its activations and compute transients are gone by then, and
        # the unit's new gradient shards exist. FSDP copies instead of reduce-scattering on one rank.
        collective = unit_full * (c + r)
        if inputs.collective_copies and inputs.world > 1:
            collective = max(collective, 2 * unit_full * r)
        # Sharded gradients exist for the units after this one: their reduce-scatters are done.
        grads = base["params"] if inputs.loop.grads_in_backward else later_shards[span[-1]] * m * on_device
        # FSDP keeps the later unit's reduce-scatter input alive until this unit's reduce-scatter is issued.
        held = unit_fulls[u + 1] if u + 1 < len(spans) else unit_full
        for i in reversed(span):
            compute = _block_backward(prof.blocks[i], i, settings, held, scale, r)
            # The unit's blocks whose backward is done hold their unsharded gradients until its reduce-scatter.
            pending = sum(full_blocks[j] for j in span if j > i) * c
            yield MemoryBreakdown(grads=grads, gathered=gathered, activations=outer_acts + kept_acts[i],
                                  transient=compute + pending + outer_grads, phase=f"backward of block {i}", **base)
        new_shards = 0 if inputs.loop.grads_in_backward else sum(shards[j] for j in span) * m * on_device
        before = kept_acts[span[0] - 1] if span[0] > 0 else 0
        yield MemoryBreakdown(grads=grads + new_shards, gathered=gathered, activations=outer_acts + before,
                              transient=collective + outer_grads, phase=f"reduce-scatter of unit {u}", **base)


def _block_backward(block: BlockMemory, index: int, settings: StepSettings, held: int, scale: float, r: int) -> int:
    """What block ``index``'s backward allocates beyond what it kept, its unsharded parameter gradients included
    (a checkpointed block holds its input, then recomputes and runs its backward); ``held``: the elements of the
    later unit's reduce-scatter input that FSDP still holds."""
    compute = int(_inside(block, index, settings) * scale)
    if index in settings.checkpointed and index not in settings.selective and not settings.keeps(index):
        # Measured `Trainer.fit` steps (benchmarks/RESULTS.md, "against Trainer.fit") hold one more block of
        # gradient size while a fully checkpointed block recomputes and runs its backward than the fake-tensor
        # run of that block alone shows (7-12% of the step's increment without it, on DeiT-Tiny and ViT-S;
        # selective blocks were 4-9% over with it): the later unit's reduce-scatter input, which FSDP2 frees only
        # when the next reduce-scatter is issued (with 3 blocks per unit, 3 blocks' worth: DeiT-Tiny's grouped
        # auto cell). Not where the block stayed gathered (no all-gather in its backward): DeiT-Tiny's auto cell
        # with kept, fully checkpointed blocks is 14% over with it.
        compute += held * r
    return compute
