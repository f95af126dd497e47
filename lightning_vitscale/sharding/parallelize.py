"""The ordered pipeline that turns a plain model into the recipe; one screen, each step says why."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vitscale.discovery import ModuleSelector, describe_blocks, holds_parameters
from lightning_vitscale.discovery.blocks import Unit, find_holding_units, outer_layers_of, reused_modules
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.discovery.unit_runs import UnitRuns
from lightning_vitscale.init import Creation, InitialWeights
from lightning_vitscale.kernels import AttentionRouter, tensor_core_report
from lightning_vitscale.precision import PrecisionPolicy, ReplicatedNorms, cast_floating_inputs, layers_compute_as_o2
from lightning_vitscale.sharding.direct_gradients import wait_for_reductions
from lightning_vitscale.sharding.fsdp import contiguous_parameters, mixed_precision_policy, offload_policy
from lightning_vitscale.sharding.pipeline_facts import InitFacts, PipelineFacts, TensorParallelFacts, UnitFacts
from lightning_vitscale.sharding.resolved import ResolvedConfig, resolve_config
from lightning_vitscale.sharding.settings import ParallelConfig, unit_reshard
from lightning_vitscale.sharding.stand_ins import not_in_a_stack
from lightning_vitscale.sharding.steps import (
    Named,
    apply_ac,
    apply_attention_routing,
    apply_compile,
    apply_fsdp,
    apply_prefetch,
    apply_tp,
    replicate_norms,
)
from lightning_vitscale.sharding.summary import SetupSummary, reused_blocks_fix, summary_from_facts
from lightning_vitscale.sharding.whole_terms import pause_in_forwards


class NoBlocksMatchedError(ValueError):
    """The user named block classes or a predicate that matched nothing: sharding would silently be coarse."""


@dataclass
class Parallelized:
    """What the pipeline leaves behind: the summary, the fp32 norms, the attention router still to decide, which
    blocks could share a unit (a plan made at the first step predicts these units)."""

    plan: SetupSummary
    norms: ReplicatedNorms | None
    router: AttentionRouter | None = None
    runs: UnitRuns | None = None


def parallelize(
    outer_unit: nn.Module, model: nn.Module, mesh: DeviceMesh, config: ResolvedConfig | ParallelConfig,
    precision: PrecisionPolicy, device: torch.device, creation: Creation | None = None,
    tensor_mesh: DeviceMesh | None = None, calls: Calls | None = None, kept_gathered: Collection[str] = (),
    keep_every_unit: bool = False,
) -> Parallelized:
    """Apply the recipe to ``model`` (held by ``outer_unit``, the module Lightning actually calls).

    ``creation``: how ``configure_model()`` built meta parameters (``None``: built before setup). ``precision`` and
    ``device`` have no default: one would silently run a bf16 GPU job as fp32 on CPU. ``calls``: what a step measured
    at setup called (the units, the tensor-parallel proofs' inputs); ``kept_gathered``: the planner's choice;
    ``keep_every_unit``: every block kept gathered (one rank without a batch at setup:
    ``batchless_units.one_rank_keeps``).
    """
    resolved = config if isinstance(config, ResolvedConfig) else resolve_config(config, device)
    found = _Found.of(model, resolved, calls)  # before anything rewrites the tree (FSDP renames the classes)
    blocks = found.blocks
    # 1. Starting weights: rank 0's everywhere (DDP's guarantee) or, on the meta path, the model's own init,
    #    delivered to each unit's shards as it is sharded (step 4), so no rank holds a second copy.
    made_contiguous = contiguous_parameters(model)  # FSDP2 shards contiguous parameters only (channels_last)
    weights = InitialWeights(model, mesh, device, creation, tensor_mesh=tensor_mesh)
    # 1b. Tensor parallelism inside each block before anything wraps it (torch's composition: parallelize_module,
    #     then fully_shard over the data-parallel dimension); checkpointing and compile then see the split block.
    tensor = _split_blocks(model, blocks, tensor_mesh, resolved, weights, calls, device)
    # 2. Norm precision first: the fp32 norms must leave the low-precision units before FSDP sees them.
    norms = replicate_norms(model, mesh, precision, weights)
    one_unit = _sharding_buys_nothing(mesh, tensor_mesh, resolved, blocks, kept_gathered, keep_every_unit)
    order = calls.order if found.measured and calls is not None else ()  # the blocks it called, in call order
    runs = UnitRuns.of(found.units, found.measured, order)  # which blocks may share a unit: the planner's too
    _compute_dtypes(model, blocks, norms.modules, precision, one_unit)
    #    Attention routing inside each block's own forward, so checkpointing's recompute is routed as well.
    router = apply_attention_routing(blocks, resolved.kernels.attention, device)
    # 3. Activation checkpointing patches the block forwards before FSDP registers its hooks around them.
    checkpointing = apply_ac(blocks, resolved.checkpoint_mode)
    # 3b. Regional compilation after checkpointing (the recompute is traced too), before FSDP (its hooks stay eager
    #     around the compiled block). The outer unit's layers only on request: the step code around them is the user's.
    outer = _outer_subtrees(model, blocks, norms.modules) if resolved.kernels.compile_outer else []
    compiled = apply_compile(blocks, outer, resolved.kernels)
    tensor_cores = tensor_core_report(model)  # on the plain model, before FSDP wraps it
    # 4. Blocks sharded bottom-up, then the outer unit on the module Lightning calls, which takes only what no
    #    block owns: peak memory is one unit's gathered parameters, not the model's. A 2-D mesh shards along its
    #    last dimension and replicates along the first (hybrid sharding).
    units = _shard(outer_unit, model, found, mesh, weights, norms.ignored, resolved, precision, device,
                   blocks_per_unit=max(1, len(blocks)) if keep_every_unit else resolved.blocks_per_unit,
                   one_unit=one_unit, runs=runs)
    # 5. Explicit prefetch once every unit exists: each unit starts the next one's all-gather (next as the
    #    measured step called them, not as registered: a stack run in reverse). Where parameters are
    #    shards in a step (not one rank's compute copies), a step's own arithmetic on them is taken whole outside the
    #    blocks' forwards only (sharding/whole_terms.py), and its gradients wait for the reductions in flight.
    overlap = apply_prefetch(units, resolved.prefetch, mesh, device, model, order)
    if not units.copies:
        pause_in_forwards([block for _, block in blocks])
        wait_for_reductions(units.all, device)
    # 6. Last, once every unit holds its values: name what the meta path could not reproduce.
    init = InitFacts(*weights.finish(), not_reproduced=list(weights.not_reproduced))
    facts = PipelineFacts(
        world_size=mesh.size(), model_class=type(model).__name__, blocks=[name for name, _ in blocks],
        described=found.described, norms=norms, checkpointing=checkpointing, compiled=compiled, router=router,
        kernels=resolved.kernels, tensor_core_misses=tensor_cores, units=units, overlap=overlap, init=init,
        params=list(model.parameters()), precision=precision.name, tensor=tensor, joined=found.joined,
        made_contiguous=made_contiguous, reused=found.reused,
    )
    return Parallelized(summary_from_facts(facts), norms.replicated, router, runs)


@dataclass
class _Found:
    """The blocks the pipeline acts on, read off the plain model before any step rewrites it."""

    units: list[Unit]  # each unit's name and the blocks it joins (a block alone, or a group a step runs as one)
    blocks: Named  # every block, in unit order
    joined: dict[str, list[str]]  # a unit of several modules -> their classes (the summary's)
    described: dict[str, int]  # class -> blocks of it, read before FSDP renames the classes (FSDP<Block>)
    reused: list[tuple[str, str, int]]  # no blocks: the modules the step ran several times each
    measured: bool  # whether a step ran at setup (its calls order the units)

    @classmethod
    def of(cls, model: nn.Module, resolved: ResolvedConfig, calls: Calls | None) -> _Found:
        units = select_units(model, resolved.sharding.blocks, calls, resolved.sharding.units_in_call_order)
        blocks = [pair for _, unit in units for pair in unit]
        several = [(name, parts) for name, parts in units if [name] != [n for n, _ in parts]]
        return cls(
            units=units, blocks=blocks,
            joined={name: [type(m).__name__ for _, m in parts] for name, parts in several},
            described=describe_blocks(blocks), reused=_reused_instead_of_blocks(model, units, resolved, calls),
            measured=calls is not None and bool(calls.called) and not calls.error,
        )


def _split_blocks(
    model: nn.Module, blocks: Named, tensor_mesh: DeviceMesh | None, resolved: ResolvedConfig,
    weights: InitialWeights, calls: Calls | None, device: torch.device,
) -> TensorParallelFacts | None:
    """Tensor parallelism inside each block (``tensor_mesh``; ``None``: none). A model from configure_model() is
    split on meta on every rank; its values arrive with FSDP's shards."""
    if tensor_mesh is None:
        return None
    weights.hold([block for _, block in blocks])
    return apply_tp(model, blocks, mesh=tensor_mesh, plan=resolved.sharding.tensor_plan, init_path=weights.path,
                    calls=calls, device=device)


def _compute_dtypes(
    model: nn.Module, blocks: Named, norm_modules: Named, precision: PrecisionPolicy, one_unit: bool
) -> None:
    """Outer-unit layers take inputs in the compute dtype even when made in fp32 (blocks in the outer unit too); the
    step's own code computes as under DDP's AMP (the plugin's autocast), blocks and layers as O2."""
    if precision.compute != torch.float32:
        outer_layers = outer_layers_of(model, blocks, norm_modules)
        cast_floating_inputs(outer_layers + [(n, b) for n, b in blocks if one_unit], precision.compute)
    if precision.compute != precision.master:
        layers_compute_as_o2([module for _, module in blocks + outer_layers_of(model, blocks, [])])


def _shard(
    outer_unit: nn.Module, model: nn.Module, found: _Found, mesh: DeviceMesh, weights: InitialWeights,
    ignored: set[nn.Parameter] | None, resolved: ResolvedConfig, precision: PrecisionPolicy, device: torch.device,
    *, blocks_per_unit: int, one_unit: bool, runs: UnitRuns,
) -> UnitFacts:
    """The FSDP units (``steps.apply_fsdp``) with the dtypes, offload and resharding the configuration resolved."""
    sharding = resolved.sharding
    return apply_fsdp(
        outer_unit, [block for _, block in found.blocks], mesh=mesh, weights=weights,
        mp_policy=mixed_precision_policy(precision), offload=offload_policy(sharding.offload, device),
        reshard_after_forward=sharding.reshard_after_forward, blocks_per_unit=blocks_per_unit, ignored=ignored,
        runs=runs, one_unit=one_unit, skippable=sharding.find_unused_parameters is True,
        find_unused=bool(sharding.find_unused_parameters), keep_out=_not_stood_in(model, found.blocks, resolved, mesh),
    )


def select_units(
    model: nn.Module, selector: ModuleSelector | None, calls: Calls | None = None, in_call_order: bool = True
) -> list[Unit]:
    """The blocks to shard, checkpoint and compile (each holding parameters), as the modules of each that a training
    step runs (``calls``, where it ran to the end; else the model's structure says what can run), in the order it
    calls them (``in_call_order``; the planner lists them so); loud if the user's selector matched nothing, or if the
    model has nothing to shard at all."""
    if not holds_parameters(model):
        raise ValueError(
            f"{type(model).__name__} has no parameters, so there is nothing to shard. Create the layers in"
            " `__init__` or in `configure_model()` (which VitScaleStrategy calls before sharding)."
        )
    called = calls.called if calls is not None and calls.called and not calls.error else None
    fed, order = (calls.fed, calls.order) if called is not None and calls is not None else (None, ())
    units = find_holding_units(model, selector, called, fed, order if in_call_order else ())
    if selector is not None and not units:
        raise NoBlocksMatchedError(
            f"`blocks={selector!r}` matched no module with parameters in {type(model).__name__}"
            + (" that a training step calls" if called is not None else "") + "."
            " Pass the class of the repeated block (e.g. blocks={MyBlock}) or leave `blocks=None` to find them."
        )
    return units


def _reused_instead_of_blocks(
    model: nn.Module, found: list[Unit], resolved: ResolvedConfig, calls: Calls | None
) -> list[tuple[str, str, int]]:
    """Where discovery found no repeated blocks, the modules the measured step ran several times each (a block
    whose weights every layer shares): ``(name, class, calls per step)``, named in the summary's notes as the fix.
    Warned as well where ``activation_checkpointing`` asked for checkpointing, which then has no block to act on."""
    if found or resolved.sharding.blocks is not None:
        return []
    counts = calls.counts if calls is not None and not calls.error else {}
    reused = [(name, type(module).__name__, times) for name, module, times in reused_modules(model, counts)]
    asked = resolved.requested.checkpointing.blocks
    if asked is not None and asked is not False and asked != "auto":
        rank_zero_warn(
            f"VitScaleStrategy(activation_checkpointing={asked!r}): {type(model).__name__} has no repeated blocks,"
            " so nothing is checkpointed." + (f" {reused_blocks_fix(reused)}" if reused else
            " Name the class of the block to checkpoint: VitScaleStrategy(blocks={MyBlock}).")
        )
    return reused


def _not_stood_in(model: nn.Module, blocks: Named, resolved: ResolvedConfig, mesh: DeviceMesh) -> list[nn.Module]:
    """Under ``find_unused_parameters="units"`` on several ranks, the blocks a skipping rank could not stand in for
    (``stand_ins.not_in_a_stack``): the outer unit keeps them."""
    if not resolved.sharding.stands_in or mesh.size() == 1:
        return []
    alone = set(not_in_a_stack(blocks, model))
    return [block for name, block in blocks if name in alone]


def _sharding_buys_nothing(
    mesh: DeviceMesh, tensor_mesh: DeviceMesh | None, resolved: ResolvedConfig, blocks: Named, kept: Collection[str],
    keep_every_unit: bool = False,
) -> bool:
    """One rank, no tensor parallelism, every block kept gathered for backward: a unit of its own saves nothing."""
    keeps = keep_every_unit or unit_reshard(resolved.sharding.reshard_after_forward, outer=False) is False
    return mesh.size() == 1 and tensor_mesh is None and (keeps or {name for name, _ in blocks} <= set(kept))


def _outer_subtrees(model: nn.Module, blocks: Named, norm_modules: Named) -> Named:
    """The largest sub-modules holding parameters and no block (a patch embedding: one graph), what
    ``compile_outer`` compiles; no norm on its own (one kernel already, its fp32 forward is precision/norms.py's)."""
    block_ids = {id(block) for _, block in blocks}
    skipped = {id(m) for _, m in norm_modules}
    holds_block: set[int] = set()
    for name, _ in blocks:
        parts = name.split(".")
        holds_block.update(id(model.get_submodule(".".join(parts[:i]))) for i in range(len(parts)))
    found: Named = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in block_ids or id(child) in skipped:
                continue
            if id(child) in holds_block:
                visit(name, child)
            elif holds_parameters(child):
                found.append((name, child))

    visit("", model)
    return found

