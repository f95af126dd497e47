"""The ordered pipeline that turns a plain model into the recipe; one screen, each step says why."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from lightning_vitscale._utils import full_bytes, local_bytes
from lightning_vitscale.discovery import describe_blocks, find_blocks, holds_parameters
from lightning_vitscale.init import Creation, InitialWeights
from lightning_vitscale.kernels import (
    AttentionRouter,
    KernelPolicy,
    apply_regional_compile,
    describe_router,
    make_router,
    resolve_kernels,
    route_blocks,
    tensor_core_report,
    usable_backends,
)
from lightning_vitscale.precision import PrecisionPolicy, ReplicatedNorms, cast_floating_inputs
from lightning_vitscale.sharding.activation_checkpointing import (
    CHECKPOINT_MODES,
    apply_activation_checkpointing,
    is_self_checkpointing,
)
from lightning_vitscale.sharding.cpu_overlap import overlap_collectives_on_cpu
from lightning_vitscale.sharding.fsdp import (
    group_blocks,
    mixed_precision_policy,
    offload_policy,
    set_prefetch,
    shard_module,
)
from lightning_vitscale.sharding.settings import ParallelConfig, unit_reshard
from lightning_vitscale.sharding.summary import ParallelPlan


class NoBlocksMatchedError(ValueError):
    """The user named block classes or a predicate that matched nothing: sharding would silently be coarse."""


@dataclass
class Parallelized:
    """What the pipeline leaves behind: the setup summary, the fp32 norms whose gradients need reducing, and the
    attention router still to decide for (``attention="auto"``)."""

    plan: ParallelPlan
    norms: ReplicatedNorms | None
    router: AttentionRouter | None = None


def parallelize(
    outer_unit: nn.Module,
    model: nn.Module,
    mesh: DeviceMesh,
    config: ParallelConfig,
    precision: PrecisionPolicy,
    device: torch.device,
    creation: Creation | None = None,
) -> Parallelized:
    """Apply the recipe to ``model`` (held by ``outer_unit``, the module Lightning actually calls).

    Order matters: blocks are found before anything rewrites the tree; norms leave the low-precision units
    before FSDP sees them; checkpointing patches block forwards before FSDP registers its hooks; blocks are
    sharded bottom-up before the outer unit, so the outer unit only takes what no block owns; meta parameters
    get their starting values unit by unit as they are sharded (``creation`` says how ``configure_model()`` built
    them; ``None``: the model existed before setup). ``precision`` and ``device`` are required: a default would
    silently run a bf16 GPU job as fp32 on CPU.
    """
    _check_has_parameters(model)
    blocks = [(name, block) for name, block in find_blocks(model, config.sharding.blocks) if holds_parameters(block)]
    if config.sharding.blocks is not None and not blocks:
        raise NoBlocksMatchedError(
            f"`blocks={config.sharding.blocks!r}` matched no module with parameters in {type(model).__name__}."
            " Pass the class of the repeated block (e.g. blocks={MyBlock}) or leave `blocks=None` to find them."
        )
    described = describe_blocks(blocks)  # before FSDP renames the classes (FSDP<Block>)

    # 1. Starting weights: rank 0's everywhere (DDP's guarantee) or, on the meta path, the model's own init,
    #    delivered to each unit's shards right after that unit is sharded (below), so no rank holds a second copy.
    weights = InitialWeights(model, mesh, device, creation)

    # 2. Norms keep fp32 parameters and compute, replicated outside the low-precision units (the recipe's
    #    stability fix at one extra collective per step, instead of one unit per norm).
    norm_modules = precision.separate_norm_modules(model)
    weights.prepare([m for _, m in norm_modules])  # their values and device first: they stay out of the units
    norms = (
        ReplicatedNorms([m for _, m in norm_modules], mesh, precision.norm_dtype)
        if norm_modules and precision.norm_dtype is not None  # always set where separate_norms found modules
        else None
    )
    ignored = norms.ignored() if norms else None

    # 2b. Outer-unit layers take their inputs in the compute dtype even when a step made them in fp32.
    if precision.compute != torch.float32:
        cast_floating_inputs(_outer_layers(model, blocks, norm_modules), precision.compute)

    # 2c. Attention routing inside each block's own forward, so checkpointing's recompute is routed as well.
    kernels = resolve_kernels(config.kernels, device, usable_backends(device))  # a no-op if the strategy did it
    router = make_router(kernels.attention, device)
    if router is not None:
        route_blocks([block for _, block in blocks], router)

    # 3. Activation checkpointing, skipping blocks that already checkpoint themselves (no double recompute).
    self_ckpt = [name for name, block in blocks if is_self_checkpointing(block)]
    #    Each block in its mode: "full" recomputes the whole block, "selective" only its cheap ops.
    modes = {name: config.checkpointing.mode(index, name, block) for index, (name, block) in enumerate(blocks)}
    chosen = [(name, block) for name, block in blocks if name not in self_ckpt and modes[name] is not None]
    for mode in CHECKPOINT_MODES:
        apply_activation_checkpointing([block for name, block in chosen if modes[name] == mode], mode)

    # 3b. Regional compilation: after checkpointing (the recompute is traced too), before FSDP (its hooks stay
    #     eager around the compiled block); identical blocks share one compiled graph. The outer unit's
    #     layers only on request: the step code around them is the user's.
    compiled_blocks = [block for _, block in blocks] if kernels.compile_blocks else []
    compiled_outer = _outer_subtrees(model, blocks, norm_modules) if kernels.compile_outer else []
    if compiled_blocks or compiled_outer:
        apply_regional_compile(
            compiled_blocks + [module for _, module in compiled_outer], kernels.compile_mode, kernels.compiler
        )
    tensor_cores = tensor_core_report(model)  # on the plain model, before FSDP wraps it

    # 4. Each block its own unit: peak memory is one block's gathered parameters, not the model's.
    #    A 2-D mesh shards along its last dimension and replicates along the first (hybrid sharding).
    mp_policy = mixed_precision_policy(precision)
    offload = offload_policy(config.sharding.offload, device)
    #    `blocks_per_unit > 1`: k consecutive blocks share one unit (fewer collectives and hooks, more gathered).
    requested = config.sharding.reshard_after_forward
    groups = group_blocks([block for _, block in blocks], config.sharding.per_unit)
    block_units = [_shard_group(group, weights, mesh, mp_policy, unit_reshard(requested, outer=False), ignored,
                                offload) for group in groups]

    # 5. The outer unit on the module Lightning calls, so its pre-forward hook gathers the rest; it keeps its
    #    parameters after forward under the recipe (backward needs them at once).
    with weights.unit(outer_unit):
        outer = shard_module(outer_unit, mesh, mp_policy, unit_reshard(requested, outer=True), ignored, offload)

    # 5b. Explicit prefetch: each unit starts the next one's all-gather as soon as its own is done. On CPU the
    #     collectives become asynchronous (gloo's worker threads), or nothing would overlap there.
    units, prefetch = [outer, *block_units], config.sharding.prefetch_on(device.type)
    set_prefetch(units, prefetch)
    overlap = ""
    if device.type == "cpu" and mesh.size() > 1:
        overlap_collectives_on_cpu(units, reduce_scatters=mesh.ndim == 1)
        overlap = (f"asynchronous on CPU (all-gathers{'' if mesh.ndim > 1 else ', reduce-scatters'}),"
                   f" prefetch {prefetch}")

    # 6. Name what the meta path could not reproduce; how the weights were made goes into the summary.
    init_path, init_peak, init_seconds = weights.finish()

    params = list(model.parameters())
    plan = ParallelPlan(
        world_size=mesh.size(),
        blocks=described,
        block_names=[name for name, _ in blocks],
        units=len(groups) + 1,
        blocks_per_unit=config.sharding.per_unit,
        checkpointed=[name for name, _ in chosen],
        selective=[name for name, _ in chosen if modes[name] == "selective"],
        self_checkpointed=self_ckpt,
        fp32_modules=[name for name, _ in norm_modules],
        num_params=sum(p.numel() for p in params),
        param_bytes_full=full_bytes(params),
        param_bytes_local=local_bytes(params),
        precision=precision.name,
        notes=_notes(model, blocks, list(weights.not_reproduced)),
        kernels=_kernel_facts(kernels, compiled_blocks, compiled_outer, router),
        tensor_core_misses=tensor_cores,
        init_path=init_path,
        init_peak_bytes=init_peak,
        init_seconds=init_seconds,
        overlap=overlap,
    )
    return Parallelized(plan, norms, router)


def _shard_group(
    group: list[nn.Module],
    weights: InitialWeights,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard: bool | int,
    ignored: set[nn.Parameter] | None,
    offload: OffloadPolicy,
) -> FSDPModule:
    """One unit of consecutive blocks; each block's starting values are taken before and delivered after."""
    with ExitStack() as stack:
        for block in group:
            stack.enter_context(weights.unit(block))
        return shard_module(group, mesh, mp_policy, reshard, ignored, offload)


def _outer_layers(model: nn.Module, blocks: list, norm_modules: list) -> list[nn.Module]:
    """Sub-modules with their own parameters that belong to no block and are no norm: the outer unit's layers."""
    inside = {id(m) for _, block in blocks for m in block.modules()} | {id(m) for _, m in norm_modules}
    return [
        module
        for name, module in model.named_modules()
        if name and id(module) not in inside and any(True for _ in module.parameters(recurse=False))
    ]


def _outer_subtrees(model: nn.Module, blocks: list, norm_modules: list) -> list[tuple[str, nn.Module]]:
    """The largest sub-modules holding parameters and no block: what ``compile_outer`` compiles.

    Largest, so that e.g. a patch embedding compiles as one graph; norms on their own are skipped (one kernel
    already, and their fp32 forwards belong to precision/norms.py).
    """
    block_ids = {id(block) for _, block in blocks}
    skipped = {id(m) for _, m in norm_modules}
    holds_block: set[int] = set()
    for name, _ in blocks:
        parts = name.split(".")
        holds_block.update(id(model.get_submodule(".".join(parts[:i]))) for i in range(len(parts)))
    found: list[tuple[str, nn.Module]] = []

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


def _kernel_facts(
    kernels: KernelPolicy,
    compiled_blocks: list[nn.Module],
    compiled_outer: list[tuple[str, nn.Module]],
    router: AttentionRouter | None,
) -> dict[str, str]:
    counts = Counter(type(block).__name__ for block in compiled_blocks)
    facts = {
        "compiled blocks": ", ".join(f"{name} x{count}" for name, count in counts.items()) or "off",
        "attention": describe_router(router),
        "fused optimizer": "on" if kernels.fused_optimizer else "off",
    }
    if kernels.compile_outer:
        facts["compiled outer"] = ", ".join(name for name, _ in compiled_outer) or "nothing outside the blocks"
    return facts


def _notes(model: nn.Module, blocks: list, zero_filled: list[str]) -> list[str]:
    notes = [] if blocks else [f"no repeated blocks in {type(model).__name__}: one outer FSDP unit only"]
    if zero_filled:
        notes.append(f"{len(zero_filled)} meta tensor(s) whose init could not be reproduced (warned)")
    return notes


def _check_has_parameters(model: nn.Module) -> None:
    if not holds_parameters(model):
        raise ValueError(
            f"{type(model).__name__} has no parameters, so there is nothing to shard. Create the layers in"
            " `__init__` or in `configure_model()` (which VitScaleStrategy calls before sharding)."
        )

