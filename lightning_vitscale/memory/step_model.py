"""Per-rank memory of one training step under the recipe, phase by phase as FSDP2 runs it, and its peak. The
outer unit stays gathered through the step; one unit is gathered (+ its all-gather buffer) at a time in forward,
the current and the prefetched one in backward with the current unit's unsharded gradients and reduce-scatter
buffer; activations are freed block by block, sharded gradients grow, the optimizer step needs its temporaries.
Activations are measured (:mod:`.activations`); everything else is counted from shapes.
"""

from __future__ import annotations

import math
from itertools import accumulate

from lightning_vitscale._utils import shard_numel
from lightning_vitscale.memory.activations import BlockMemory
from lightning_vitscale.memory.step_inputs import (
    OPTIMIZER_STATES,
    OPTIMIZER_TEMPORARIES,
    MemoryBreakdown,
    StepInputs,
    StepSettings,
    unit_spans,
)


def computes_on_copies(inputs: StepInputs, settings: StepSettings) -> bool:
    """One rank, one unit kept gathered, nothing offloaded: the step computes on copies made in one foreach copy
    straight into their buffer, and casts the gradients one by one (``sharding/compute_copies.py``), not FSDP2's
    all-gather and reduce-scatter with their temporaries."""
    single = inputs.world == 1 and inputs.replicas == 1 and inputs.tensor is None and not settings.offload
    return single and settings.blocks_per_unit >= len(inputs.layout.blocks) and settings.keeps(0)


def predict_step(inputs: StepInputs, settings: StepSettings) -> MemoryBreakdown:
    """The peak of one steady-state step (optimizer state exists; gradients alive as ``inputs.loop`` orders)."""
    return max(step_phases(inputs, settings), key=lambda b: b.peak)


def step_phases(inputs: StepInputs, settings: StepSettings) -> list[MemoryBreakdown]:
    """Each phase's memory: end of forward, the backward of each block (last first), the optimizer step."""
    lay, prof, scale = inputs.layout, inputs.profile, inputs.batch_scale
    m, c, r = inputs.master.itemsize, inputs.compute.itemsize, inputs.reduce.itemsize
    states = OPTIMIZER_STATES[inputs.optimizer]
    shards = [shard_numel(b, inputs.world) for b in lay.blocks]
    params = (sum(shards) + shard_numel(lay.outer, inputs.world)) * m
    on_device = 0 if settings.offload else 1  # offloaded state lives in host memory, not on the device
    norms = sum(math.prod(s) for s in lay.norms) * 4 * (2 + states)
    full_blocks = [sum(math.prod(s) for s in b) for b in lay.blocks]
    outer_full = sum(math.prod(s) for s in lay.outer) * c
    kept = [int(_kept_and_inside(b, i, settings)[0] * scale) for i, b in enumerate(prof.blocks)]
    batch = int(prof.batch_bytes * scale)
    base = dict(params=params * on_device, optimizer=params * states * on_device, norms=norms, batch=batch)
    return [
        *_forward_phases(inputs, settings, base, full_blocks, outer_full, kept),
        *_backward_peaks(inputs, settings, base, full_blocks, shards, outer_full, kept, c, r, m, on_device),
        MemoryBreakdown(grads=params * on_device, gathered=0, activations=0,
                        transient=params * OPTIMIZER_TEMPORARIES[inputs.optimizer] * on_device,
                        phase="optimizer step", **base),
    ]


def _kept_and_inside(block: BlockMemory, index: int, settings: StepSettings) -> tuple[int, int]:
    """What a block keeps from forward to backward, and what its backward allocates beyond that."""
    mode = "selective" if index in settings.selective else "full" if index in settings.checkpointed else "none"
    if mode not in block.modes:
        raise ValueError(f"{block.name} was measured for {sorted(block.modes)} only, not {mode!r}: measure it with"
                         " mode_of=None to predict other checkpointing.")
    # Checkpointed, each call keeps its own input (selective: and outputs); backward recomputes one call at a time,
    # each as large as the measured (largest) call at most.
    if mode == "selective":
        return round(block.selective_saved * block.share), block.selective_backward
    if mode == "full":
        return round(block.input * block.share), block.recompute - block.input
    return block.saved, block.backward


def _forward_phases(inputs, settings, base, full_blocks, outer_full, kept) -> list[MemoryBreakdown]:
    """Each unit's all-gather (its output and one more unit-sized tensor: gloo's temporary, then FSDP's copy-out)
    and the end of its forward (still gathered, every activation so far); units kept for backward pile up."""
    c, scale = inputs.compute.itemsize, inputs.batch_scale
    spans = unit_spans(inputs, settings)
    grads = base["params"] if inputs.loop.grads_in_forward else 0  # sharded gradients: as many as parameters
    # The outer layers after the blocks (head, final norm) save theirs only at the end of the forward.
    outer_acts = int((inputs.profile.outer_saved - inputs.profile.outer_saved_after) * scale)
    outer_end = int(inputs.profile.outer_saved * scale)
    phases, kept_before, acts_before = [], 0, 0
    copies = computes_on_copies(inputs, settings)
    for u, span in enumerate(spans):
        unit = sum(full_blocks[i] for i in span) * c
        gathered = outer_full + kept_before + unit
        acts_after = acts_before + sum(kept[i] for i in span)
        last = u == len(spans) - 1
        phases += [
            MemoryBreakdown(grads=grads, gathered=gathered, activations=outer_acts + acts_before,
                            transient=0 if copies else unit, phase=f"all-gather of unit {u}", **base),
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
    # Running sums (the planner's search predicts thousands of plans): blocks 0..i's kept gathered parameters and
    # kept activations, blocks i+1..'s gradient shards.
    kept_gathered = list(accumulate(f if settings.keeps(j) else 0 for j, f in enumerate(full_blocks)))
    kept_acts = list(accumulate(kept))
    later_shards = [*reversed(list(accumulate(reversed(shards[1:])))), 0]
    spans = unit_spans(inputs, settings)
    cast_one_by_one = computes_on_copies(inputs, settings)  # no reduce-scatter input
    unit_fulls = [sum(full_blocks[j] for j in span) for span in spans]
    held = _held_by_autograd(prof.blocks, full_blocks, c)
    first = _first_call_kept(prof.blocks, settings, scale)  # a backbone run on several passes, else None
    final_acts = kept_acts if first is None else list(accumulate(first))  # what the last backward pass finds
    early_grads = base["params"] if inputs.loop.grads_in_backward else 0  # no reduction before the last pass
    for u in reversed(range(len(spans))):
        span, unit_full = spans[u], unit_fulls[u]
        # Units up to this one that stayed gathered, plus this unit and the prefetched previous one if they
        # resharded (a unit stays gathered until its last block's backward is done).
        resharded = sum(unit_fulls[v] for v in (u, u - 1) if v >= 0 and not settings.keeps(spans[v][0]))
        gathered = outer_full + (kept_gathered[span[-1]] + resharded) * c
        # The reduce-scatter, after the unit's first block's backward (its activations gone, its shards there):
        # FSDP's copy-in holds gradients and input at once, gloo then the input and its own copy of it.
        collective = unit_full * (c if cast_one_by_one else c + r)
        if inputs.collective_copies and inputs.world > 1:
            collective = max(collective, 2 * unit_full * r)
        # Sharded gradients exist for the units after this one: their reduce-scatters are done.
        grads = base["params"] if inputs.loop.grads_in_backward else later_shards[span[-1]] * m * on_device
        # FSDP keeps the later unit's reduce-scatter input alive until this unit's reduce-scatter is issued.
        in_flight = unit_fulls[u + 1] if u + 1 < len(spans) else 0  # none before the first unit's backward
        for i in reversed(span):
            compute = _block_backward(prof.blocks[i], i, settings, in_flight, scale, r) + held[i]
            if u + 1 < len(spans) and inputs.collective_copies and inputs.world > 1 and i not in settings.checkpointed:
                # On CPU the later unit's reduce-scatter is still in flight (cpu_overlap.py waits for it at this
                # unit's), its input and gloo's copy of it alive through this unit's backward: RSS read at each
                # post_backward of a DeiT-Tiny step (2 ranks, nothing checkpointed) peaks in block 10's backward,
                # 2.9 MiB over the model without them (0.88-0.91x). A checkpointed block counts the input already.
                compute += 2 * in_flight * r
            # The unit's blocks whose backward is done hold their unsharded gradients until its reduce-scatter.
            pending = sum(full_blocks[j] for j in span if j > i) * c
            if first is not None:
                # An earlier backward pass (the later calls', run first): every first call's activations still
                # kept, the later calls' of blocks 0..i, autograd holding the gradients of blocks i+1.., nothing
                # reduced yet.
                earlier = _block_backward(prof.blocks[i], i, settings, 0, scale, r) + held[-1] - held[i]
                yield MemoryBreakdown(grads=early_grads, gathered=gathered,
                                      activations=outer_acts + final_acts[-1] + kept_acts[i] - final_acts[i],
                                      transient=earlier + outer_grads, phase=f"backward of block {i} (an earlier pass)",
                                      **base)
            yield MemoryBreakdown(grads=grads, gathered=gathered, activations=outer_acts + final_acts[i],
                                  transient=compute + pending + outer_grads, phase=f"backward of block {i}", **base)
        new_shards = 0 if inputs.loop.grads_in_backward else sum(shards[j] for j in span) * m * on_device
        before = final_acts[span[0] - 1] if span[0] > 0 else 0
        # FSDP2 reshards a unit before it reduce-scatters (``FSDPParamGroup.post_backward``): its gathered
        # parameters, kept or not, are gone by then. Counting them over-predicted a 12-block unit kept gathered
        # with every block checkpointed by 38% (DeiT-Tiny, 2 CPU ranks). Copies on one rank live to the step's end.
        gathered -= 0 if cast_one_by_one else unit_full * c
        held_before = held[span[0] - 1] if span[0] > 0 else 0
        yield MemoryBreakdown(grads=grads + new_shards, gathered=gathered, activations=outer_acts + before,
                              transient=collective + outer_grads + held_before, phase=f"reduce-scatter of unit {u}",
                              **base)


def _first_call_kept(blocks: list[BlockMemory], settings: StepSettings, scale: float) -> list[int] | None:
    """Per block, what its first call keeps for backward, where the backbone runs on several passes a step (two or
    more blocks called more than once: DINO's crop sizes); ``None`` otherwise (a block every layer shares runs its
    calls in one pass). The first call's backward runs last: by then the later passes' activations are freed (both
    counted at once, a two-pass DeiT-Tiny step at batch 32 read 0.84 of the prediction)."""
    if sum(block.calls > 1 for block in blocks) < 2:
        return None
    kept = []
    for i, block in enumerate(blocks):
        if block.calls == 1:
            kept.append(_kept_and_inside(block, i, settings)[0])
        elif i in settings.selective:
            kept.append(round(block.selective_saved * block.first_share))
        elif i in settings.checkpointed:
            kept.append(round(block.input * block.first_share))
        else:
            kept.append(block.saved if block.first_saved is None else block.first_saved)
    return [int(k * scale) for k in kept]


def _held_by_autograd(blocks: list[BlockMemory], full_blocks: list[int], c: int) -> list[int]:
    """Per block ``i``: the unsharded gradients autograd holds at its backward, of the blocks ``0..i`` a step runs
    more than once (a backbone run on each crop size, a block every layer shares). Autograd sums a parameter's
    gradient over its calls and writes it once, after the first call's backward (the last to run), so FSDP2 reduces
    nothing before (``sharding/deferred_reduction.py``): each such block's gradient is alive from its last call's
    backward until its first call's (counted by patching ``post_backward``: no gradient in a two-pass backbone's
    first pass, all of them in the second; RSS grew ~2.3 MiB a DeiT-Tiny unit through the first pass)."""
    return list(accumulate(full * c if block.calls > 1 else 0 for block, full in zip(blocks, full_blocks)))


def _block_backward(block: BlockMemory, index: int, settings: StepSettings, held: int, scale: float, r: int) -> int:
    """What block ``index``'s backward allocates beyond what it kept; ``held``: the elements of the later unit's
    reduce-scatter input FSDP still holds."""
    compute = int(_kept_and_inside(block, index, settings)[1] * scale)
    if index in settings.checkpointed and index not in settings.selective and not settings.keeps(index):
        # Measured `Trainer.fit` steps (benchmarks/RESULTS.md, "against Trainer.fit") hold the later unit's
        # reduce-scatter input too while a fully checkpointed block recomputes (FSDP2 frees it at the next
        # reduce-scatter): 7-12% under without it on DeiT-Tiny and ViT-S; selective blocks were 4-9% over with it,
        # and kept blocks (no all-gather in backward) 14% over.
        compute += held * r
    return compute
