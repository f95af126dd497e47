"""The parallelize pipeline's steps (torchtitan's ``apply_*``): each applies one thing to explicit module lists and
returns a small record of what it did, from which the setup summary is built (``summary.summary_from_facts``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import ExitStack

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lightning_vitscale._utils import parents
from lightning_vitscale.discovery.blocks import Named
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.discovery.tensor_plan import TensorPlanSelector, plan_block
from lightning_vitscale.discovery.unit_runs import UnitRuns, in_call_order
from lightning_vitscale.init import InitialWeights
from lightning_vitscale.kernels import AttentionRouter, KernelPolicy, apply_regional_compile, make_router, route_blocks
from lightning_vitscale.memory import refuse_selective_calling_blocks
from lightning_vitscale.precision import PrecisionPolicy, ReplicatedNorms
from lightning_vitscale.sharding.activation_checkpointing import (
    CHECKPOINT_MODES,
    CheckpointMode,
    apply_activation_checkpointing,
    is_self_checkpointing,
)
from lightning_vitscale.sharding.compute_copies import ComputeCopies, to_row_shards
from lightning_vitscale.sharding.cpu_overlap import overlap_collectives_on_cpu
from lightning_vitscale.sharding.deferred_reduction import DeferredReduction
from lightning_vitscale.sharding.fsdp import batch_as_given, prefetch_on_entry, set_prefetch, shard_module
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.pipeline_facts import (
    CheckpointFacts,
    CompileFacts,
    NormFacts,
    TensorParallelFacts,
    UnitFacts,
)
from lightning_vitscale.sharding.scalar_parameters import find_unshardable_parameters, replicate_unshardable
from lightning_vitscale.sharding.settings import unit_reshard
from lightning_vitscale.sharding.skipped_blocks import zero_gradients_for_unused
from lightning_vitscale.sharding.tensor_parallel import same_values_everywhere, split_block
from lightning_vitscale.sharding.tensor_proof import prove_plans
from lightning_vitscale.sharding.unit_groups import nested_first, shared_apart, without_tied_parameters


def apply_tp(
    model: nn.Module, blocks: Named, *, mesh: DeviceMesh, plan: TensorPlanSelector | None, init_path: str,
    calls: Calls | None, device: torch.device,
) -> TensorParallelFacts:
    """Split every block over ``mesh`` (the tensor-parallel dimension) by its plan, each distinct plan proven first
    (``tensor_proof.py``). Every rank ends with global rank 0's values (DDP's guarantee): ``init_path="built"``
    broadcasts them first; ``"exact"``/``"meta"`` split meta tensors, and each unit's 2-D shards get their values
    as FSDP shards it (``InitialWeights.hold``)."""
    built = init_path == "built"
    if built:
        same_values_everywhere(model)
    proofs = prove_plans(blocks, plan=plan, mesh=mesh, calls=calls, device=device, real_values=built)
    plans = [(name, block, plan_block(name, block, mesh.size(), plan)) for name, block in blocks]
    interleaved: list[str] = []
    for name, block, block_plan in plans:
        split_block(block, mesh, block_plan, values_everywhere=built)
        interleaved += [f"{name}.{n}" for n, role in block_plan.styles.items() if role == "packed_colwise"]
    described = {type(b).__name__: f"{p.describe()}; {p.whole(b)}; {proofs[type(b).__name__]}" for _, b, p in plans}
    return TensorParallelFacts(mesh.size(), described, interleaved)


def apply_attention_routing(blocks: Named, attention: str, device: torch.device) -> AttentionRouter | None:
    """Route each block's SDPA calls (``attention=``) inside its own forward, so checkpointing's recompute is too."""
    router = make_router(attention, device)
    if router is not None:
        route_blocks([block for _, block in blocks], router)
    return router


def apply_ac(blocks: Named, mode_of: Callable[[int, str, nn.Module], CheckpointMode | None]) -> CheckpointFacts:
    """Checkpoint each block in the mode ``mode_of`` gives (asked for every block, in model order), skipping blocks
    that checkpoint themselves (no double recompute)."""
    self_ckpt = [name for name, block in blocks if is_self_checkpointing(block)]
    modes = {name: mode_of(index, name, block) for index, (name, block) in enumerate(blocks)}
    chosen: dict[str, CheckpointMode] = {
        name: mode for name, mode in modes.items() if name not in self_ckpt and mode is not None
    }
    refuse_selective_calling_blocks(blocks, [name for name, mode in chosen.items() if mode == "selective"])
    by_name = dict(blocks)
    for mode in CHECKPOINT_MODES:
        apply_activation_checkpointing([by_name[name] for name, m in chosen.items() if m == mode], mode)
    return CheckpointFacts(chosen, self_ckpt)


def apply_compile(blocks: Named, outer: Named, kernels: KernelPolicy) -> CompileFacts:
    """``torch.compile`` each block in place (identical blocks share one graph); ``outer`` with ``compile_outer``."""
    compiled_blocks = [block for _, block in blocks] if kernels.compile_blocks else []
    compiled_outer = outer if kernels.compile_outer else []
    apply_regional_compile(compiled_blocks + [module for _, module in compiled_outer], kernels.compile_mode,
                           kernels.compiler)
    return CompileFacts(
        [type(block).__name__ for block in compiled_blocks],
        [name for name, _ in compiled_outer] if kernels.compile_outer else None,
    )


def apply_fsdp(
    outer_unit: nn.Module, blocks: list[nn.Module], *, mesh: DeviceMesh, weights: InitialWeights,
    mp_policy: MixedPrecisionPolicy, offload: OffloadPolicy, reshard_after_forward: bool | int | None,
    blocks_per_unit: int, ignored: set[nn.Parameter] | None, runs: UnitRuns, one_unit: bool = False,
    skippable: bool = False, find_unused: bool = False, keep_out: Collection[nn.Module] = (),
) -> UnitFacts:
    """One FSDP unit per ``blocks_per_unit`` consecutive blocks as ``runs`` allow (the planner predicts the same
    spans: :meth:`~lightning_vitscale.discovery.unit_runs.UnitRuns.spans`), bottom-up, then
    the outer unit; ``weights`` delivers each unit's values to its shards as it is made, so no rank holds a second
    copy of the model. ``one_unit``: a single block unit kept gathered on one rank overlaps nothing
    and saves no memory: the blocks join the outer unit (one FSDP2 pre-forward hook per step, not one per block).
    ``skippable`` (``find_unused_parameters=True``): ranks may skip blocks, so every block joins the outer unit, whose
    forward every rank runs. On several ranks an unused parameter is reduced as a zero gradient
    (``skipped_blocks.py``), which ``find_unused`` (the flag set) cannot do without; ``keep_out``: blocks left in the
    outer unit (``find_unused_parameters="units"``: ``stand_ins.not_in_a_stack``)."""
    out = {id(block) for block in keep_out}
    spans = runs.spans(blocks_per_unit, sharing=not one_unit)
    groups = [unit for span in spans for unit in shared_apart([blocks[i] for i in span])]
    groups = nested_first([kept for kept in ([b for b in group if id(b) not in out] for group in groups) if kept])
    in_groups = sum(map(len, groups))
    if skippable:  # every block to the outer unit (find_unused_parameters=True), tied or not
        groups, tied, skipped = [], 0, in_groups
    else:
        groups = without_tied_parameters(groups, outer_unit)
        tied, skipped = in_groups - sum(map(len, groups)), 0
    if one_unit and len(groups) == 1:
        groups = []
    block_units = []
    for group in groups:
        with ExitStack() as stack:
            for block in group:
                stack.enter_context(weights.unit(block))
            reshard = unit_reshard(reshard_after_forward, outer=False)
            block_units.append(shard_module(group, mesh, mp_policy, reshard, ignored, offload))
    # One rank and one unit: compute copies instead of FSDP2's per-parameter path (sharding/compute_copies.py).
    # FSDP2 still makes the root (a step stays an FSDP2 forward, as with units), ignoring every parameter.
    copies = not block_units and one_unit and not isinstance(offload, CPUOffloadPolicy)
    copies_owner = outer_unit if copies and isinstance(outer_unit, OuterUnit) else None
    norm_params = list(ignored or ())
    with weights.unit(outer_unit):
        reshard = unit_reshard(reshard_after_forward, outer=True)
        if copies_owner is not None:
            sharded = to_row_shards(outer_unit, mesh, weights.device, {id(p) for p in norm_params})
            ignored = set(norm_params) | set(sharded)
        outer = shard_module(outer_unit, mesh, batch_as_given(mp_policy), reshard, ignored, offload)
    if mesh.size() > 1:  # a parameter one rank leaves unused cannot shift the others' reduce-scatters
        zero_gradients_for_unused(outer, required=find_unused)
        if block_units:  # a unit called again in a step reduces once, after its first call's backward
            deferred = DeferredReduction(outer, block_units)
            if isinstance(outer_unit, OuterUnit):
                outer_unit.deferred_reduction = deferred
    if copies_owner is not None:
        compute = mp_policy.param_dtype or (sharded[0].dtype if sharded else torch.float32)
        copies_owner.compute_copies = ComputeCopies(copies_owner, sharded + norm_params, compute)
    return UnitFacts(outer, block_units, blocks_per_unit, copies_owner is not None, tied, skipped, len(out),
                     tuple(map(tuple, groups)))


def apply_prefetch(
    made: UnitFacts, prefetch: int, mesh: DeviceMesh, device: torch.device, model: nn.Module, order: Sequence[str] = ()
) -> str:
    """Each unit starts the next ``prefetch`` units' all-gathers once its own is done, where one call of their
    container runs both; "next" as a measured step called them (``order``: its blocks, in call order; empty: model
    order). On CPU the collectives are made asynchronous too (gloo's worker threads), or nothing would overlap there.
    Returns the summary's words."""
    names = {id(module): name for name, module in model.named_modules()}
    members = [[names.get(id(module), "") for module in unit] for unit in made.members]
    units = [made.outer, *(made.block_units[index] for index in in_call_order(members, order))]
    parent_of = parents(model)
    same_call = lambda a, b: parent_of.get(id(a)) is parent_of.get(id(b))  # noqa: E731
    set_prefetch(units, prefetch, same_call)
    if prefetch > 0:  # the first unit of each container, which no unit before it prefetches: as its callers start
        for index in range(1, len(units)):
            if index == 1 or not same_call(units[index - 1], units[index]):
                prefetch_on_entry(units[index], _callers(units[index], parent_of, model))
    if device.type != "cpu" or mesh.size() <= 1:
        return ""
    overlap_collectives_on_cpu(units, reduce_scatters=mesh.ndim == 1)
    gathers = "all-gathers" + ("" if mesh.ndim > 1 else ", reduce-scatters")
    return f"asynchronous on CPU ({gathers}), prefetch {prefetch}"


def _callers(unit: object, parent_of: dict[int, nn.Module], model: nn.Module) -> list[nn.Module]:
    """The modules above ``unit`` up to ``model``, not ``model`` itself (the LightningModule: Lightning's forward
    redirection calls it for ``training_step``, before the user's code in the step)."""
    callers, module = [], parent_of.get(id(unit))
    while module is not None and module is not model:
        callers.append(module)
        module = parent_of.get(id(module))
    return callers


def replicate_norms(
    model: nn.Module, mesh: DeviceMesh, precision: PrecisionPolicy, weights: InitialWeights
) -> NormFacts:
    """Norms keep fp32 parameters and compute, replicated outside the low-precision units (one extra collective
    per step instead of one unit per norm); their values and device are prepared first, as no unit delivers them."""
    norm_modules = precision.separate_norm_modules(model)
    weights.prepare([m for _, m in norm_modules])
    norms = (
        ReplicatedNorms([m for _, m in norm_modules], mesh, precision.norm_dtype)
        if norm_modules and precision.norm_dtype is not None  # always set where separate_norms found modules
        else None
    )
    return _replicate_scalars(model, mesh, NormFacts(norm_modules, norms), weights)


def _replicate_scalars(model: nn.Module, mesh: DeviceMesh, norms: NormFacts, weights: InitialWeights) -> NormFacts:
    """0-dim and complex parameters, which FSDP2 cannot shard, replicated with the norms (made for them where there
    are none: a full-precision model), their values prepared as the norms' are."""
    found = find_unshardable_parameters(model)
    if not found:
        return norms
    weights.prepare_parameters([(owner, attr) for _, owner, attr in found])
    replicated = norms.replicated or ReplicatedNorms([], mesh)
    replicate_unshardable(model, found, replicated)
    return NormFacts(norms.modules, replicated, [name for name, _, _ in found])
