"""Sharding a LightningModule once (the strategy's ``setup``: :func:`shard_lightning_module`, in order), reused by a
later Trainer only under the same settings; its result, :class:`~.sharded_model.ShardedModel`, is what the steps
still need from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import initialize_fsdp_root, set_lightning_device
from lightning_vitscale._utils import abbreviated
from lightning_vitscale.checkpoint import full_state_dict, state_dict_writes
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.distributed import RankContext
from lightning_vitscale.distributed.mesh import shard_size
from lightning_vitscale.init import Creation
from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.memory import PlanningBatch, planning_batch
from lightning_vitscale.precision import PrecisionPolicy, ReplicatedNorms, VitScalePrecision
from lightning_vitscale.sharding import plain_copy
from lightning_vitscale.sharding.activation_checkpointing import mark_parent_checkpointing
from lightning_vitscale.sharding.buffer_sync import BufferSync
from lightning_vitscale.sharding.deferred_compile import DeferredCompile
from lightning_vitscale.sharding.first_gathers import FirstGathers
from lightning_vitscale.sharding.fsdp import gathered_and_resharded
from lightning_vitscale.sharding.in_step_calls import InStepCalls
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import Parallelized, parallelize
from lightning_vitscale.sharding.parameter_writes import make_parameters_assignable
from lightning_vitscale.sharding.planning import agreed_budget, plan_before_sharding, plans_from_batch
from lightning_vitscale.sharding.refused_callbacks import refuse_unshardable_callbacks
from lightning_vitscale.sharding.resolved import ResolvedConfig, compile_at_first_step, compile_where_it_pays
from lightning_vitscale.sharding.settings import ParallelConfig, ShardingPolicy
from lightning_vitscale.sharding.sharded_model import ShardedModel
from lightning_vitscale.sharding.skipped_blocks import SkippedBlockCheck, UnusedParameters
from lightning_vitscale.sharding.stand_ins import StandIns
from lightning_vitscale.sharding.summary import SetupSummary
from lightning_vitscale.sharding.traffic import layout_report
from lightning_vitscale.sharding.unit_members import outer_unit_parameters
from lightning_vitscale.sharding.unshardable import refuse_unshardable_parameters
from lightning_vitscale.sharding.user_grad_hooks import UserGradientHooks

_SHARDED_ATTR = "_vitscale_sharded_model"


class ShardedModuleReuseError(RuntimeError):
    """A LightningModule sharded under some settings was handed to a Trainer with other settings."""


def check_reusable(used: dict[str, Any], wanted: dict[str, Any]) -> None:
    """A sharded module is rebuilt by nobody: FSDP units, checkpointing and casts are in place. Refuse to pretend."""
    changed = [f"{key} {used[key]!r} -> {wanted[key]!r}" for key in wanted if used.get(key) != wanted[key]]
    if changed:
        raise ShardedModuleReuseError(
            "This LightningModule was already sharded by a VitScaleStrategy with other settings ("
            + "; ".join(changed)
            + "). Its FSDP units, activation checkpointing and precision casts cannot be undone in place. Build a"
            " new LightningModule instance for this Trainer, or pass the same strategy settings as before."
        )


def sharding_signature(
    config: ParallelConfig, precision: PrecisionPolicy, world_size: int, device: torch.device,
    kernels: KernelPolicy | None = None,
) -> dict[str, Any]:
    """The settings a module is sharded with; ``kernels``: ``config.kernels`` resolved on ``device``, where known."""
    return {
        "blocks=": config.sharding.blocks,
        "reshard_after_forward=": config.sharding.reshard_after_forward,
        "sharding=": config.sharding.layout,
        "blocks_per_unit=": config.sharding.blocks_per_unit,
        "offload=": config.sharding.offload,
        "activation_checkpointing=": config.checkpointing.blocks,
        "priority=": config.priority,
        "kernels=": kernels if kernels is not None else config.kernels,
        "precision": precision,
        "world size": world_size,
        "device": device,
    }


def shard_lightning_module(
    module: nn.Module, resolved: ResolvedConfig, precision: VitScalePrecision, ranks: RankContext,
    creation: Creation | None, fitting: Any | None = None, trainer: Any | None = None,
) -> ShardedModel:
    """Shard ``module`` once; later calls with the same settings return the same :class:`ShardedModel`, others
    raise :class:`~lightning_vitscale.ShardedModuleReuseError`.

    ``fitting``: the Trainer about to fit, whose training data gives a batch where the module sets no
    ``example_input_array``; ``trainer``: the one the module runs under (the planner follows its loop).

    Why the module's ``__dict__`` keeps the result: ``Trainer(...).fit(m)`` then ``Trainer(...).test(m)`` gives the
    second, fresh strategy only ``m``, which must lead to the first's units and settings after the first strategy
    is gone. Its structure does not: its blocks are ``FSDPModule``s, but the outer unit is a parent of ``m`` (a
    LightningModule must not contain its own wrapper), and the settings, the planner's choices and the fp32 norms
    exist nowhere else. A registry keyed weakly by ``m`` would never drop an entry (the value holds ``m`` through
    the outer unit); one holding the value weakly would lose it with the first Trainer. torch's ``fully_shard``
    keeps its own state in the module's ``__dict__`` for the same reason (``_composable/contract.py``).
    """
    signature = sharding_signature(
        resolved.requested, precision.policy, ranks.sharding_mesh.size(), ranks.device, kernels=resolved.kernels
    )
    if fitting is not None:
        refuse_unshardable_callbacks(fitting.callbacks)
    state_dict_writes.start()  # this run's state_dict() values changed in place reach the shards (until teardown)
    sharded: ShardedModel | None = module.__dict__.get(_SHARDED_ATTR)
    if sharded is None:
        batch = planning_batch(module, fitting)
        sharded = module.__dict__[_SHARDED_ATTR] = _shard(module, resolved, precision, ranks, creation, signature,
                                                          batch, trainer)
        rank_zero_info(sharded.summary.summary())
    check_reusable(sharded.signature, signature)
    if sharded.outer.in_step_calls is not None:
        sharded.outer.in_step_calls.new_run()
    sync = BufferSync.of(module) if ranks.world_size > 1 else None
    sharded.outer.buffer_sync = sync if fitting is not None else None
    if sync is not None and fitting is None:
        sync.sync()  # as Lightning's DDP sets up to evaluate: rank 0's buffers, once
    return sharded


def _shard(
    module: nn.Module, resolved: ResolvedConfig, precision: VitScalePrecision, ranks: RankContext,
    creation: Creation | None, signature: dict[str, Any], batch: PlanningBatch | None, trainer: Any | None = None,
) -> ShardedModel:
    refuse_unshardable_parameters(module)
    user_hooks = UserGradientHooks.taken_from(module)  # before anything replaces a parameter
    mark_parent_checkpointing(module)  # before the planner: its blocks are the model's to checkpoint
    # 1. Master weights in the master dtype (norms keep theirs). No `module.to(device)`: FSDP moves each unit's
    #    shards to the device as it shards the unit, so no rank ever holds the whole model on the device.
    module = precision.convert_module(module)
    forwards = plain_copy.record_forwards(module)  # before checkpointing, compilation and routing wrap some
    outer = OuterUnit(module)
    if trainer is not None:  # `trainer.model` as after setup: a step the planner runs may call `.no_sync()` on it
        trainer.strategy.model = outer
    # 2. The planner decides before the pipeline what it can from the batch, if known (example_input_array, or
    #    one batch of the training data): "auto" checkpointing, blocks per unit, units kept gathered. It measures
    #    the plain module (or its meta twin): once sharded, running it would gather.
    budget = agreed_budget(resolved.checkpointing.memory_budget, ranks)  # once: every choice by memory keeps to it
    planned = plan_before_sharding(module, resolved, precision.policy, ranks, budget, batch, trainer)
    if planned.calls is not None and ranks.world_size > 1:  # every rank finds the blocks rank 0's step ran
        planned.calls.agree(ranks.broadcast)
    # Modules the step runs inside its own `torch.autocast(enabled=False)` compute in fp32, as under DDP's AMP.
    policy = precision.policy.keeping_fp32(planned.calls.in_fp32 if planned.calls is not None else ())
    planned = dataclasses.replace(planned, resolved=compile_where_it_pays(planned.resolved, planned.step(module),
                                                                          ranks.device))
    pending = planned.auto is not None and planned.auto.pending  # the plan waits for the first training batch
    resolved_now, compile_with = compile_at_first_step(planned.resolved, pending)
    planned = dataclasses.replace(planned, resolved=resolved_now)
    # 3. The recipe: norms, casts, attention routing, checkpointing, compile, block units, the outer unit.
    done = parallelize(
        outer, module, ranks.sharding_mesh, planned.resolved, policy, ranks.device, creation,
        tensor_mesh=ranks.tensor_mesh, calls=planned.calls, kept_gathered=planned.kept_at_setup,
        keep_every_unit=planned.keeps_every_unit,
    )
    set_lightning_device(module, ranks.device)
    if pending and planned.auto is not None:  # the first step's plan: for the units made now
        planned.auto.units_made = done.runs
    if planned.keeps_every_unit and planned.auto is not None:  # the first step's plan: the one unit made
        planned.auto.blocks_per_unit = max(1, len(done.plan.block_names))
    planned.apply(module, done.plan, ranks.device)
    # After the planner's choices are applied: units it keeps gathered send no all-gather in backward.
    _describe_layout(done.plan, outer, done.norms, policy, resolved.sharding, ranks,
                     planned.tensor_sent(done.plan))
    if policy is not precision.policy and planned.calls is not None:
        _note_full_precision(done.plan, planned.calls, policy.compute)
    # 4. Drop-in behaviour: calls outside a step gather the outer unit; state_dict() gives DDP's full tensors.
    outer.enable_calls_outside_steps()
    make_parameters_assignable(module)  # `p.data = v` writes into the shard, as it does into DDP's parameter
    if user_hooks is not None:  # `p.register_hook(fn)` from __init__: on what each gradient is computed for
        copies = outer.compute_copies
        user_hooks.install(outer, list(zip(copies.params, copies.copies)) if copies is not None else [])
    full_state_dict.install(module, outer)
    plain_copy.install(forwards, outer)  # copy.deepcopy(model): DDP's plain module, whole parameters
    # 5. FSDP's root fixed now, not at the first forward: a hook may call the model or any child before the first
    #    step, as under DDP. Every unit exists and holds real (not meta) shards by here.
    if isinstance(outer, FSDPModule):
        initialize_fsdp_root(outer)
    speed = plans_from_batch(resolved) and resolved.requested.priority == "speed"
    skipped, unused, stand_ins = _skipped_blocks(module, outer, done, resolved, ranks)
    if unused is None and ranks.world_size > 1 and planned.calls is not None and planned.calls.without_gradient:
        _note_without_gradient(done.plan, planned.calls.without_gradient)
    # Before the in-step guard, so that its hooks run after the guard's: a unit's first gather is not made in
    # inference mode (an evaluation before training, Lightning's on NCCL).
    FirstGathers([unit for unit in outer.modules() if isinstance(unit, FSDPModule)], gathered_and_resharded)
    # Last, so that its hooks run first: a call one rank makes alone in a step is refused. Not where ranks may skip
    # blocks (find_unused_parameters): their calls differ by design, stood in for (units) or in the outer unit.
    if ranks.world_size > 1 and not resolved.sharding.find_unused_parameters:
        in_units = {name: block for name in done.plan.block_names
                    if isinstance(block := module.get_submodule(name), FSDPModule)}
        outer.in_step_calls = InStepCalls(outer, in_units, lambda: outer._in_step) if in_units else None
    return ShardedModel(outer, done.plan, done.norms, done.router, planned.auto, signature, budget,
                        planned_for_speed=speed, skipped=skipped, unused=unused, stand_ins=stand_ins,
                        deferred_compile=DeferredCompile(compile_with) if compile_with is not None else None,
                        parameters=list(module.parameters()))


def _skipped_blocks(
    module: nn.Module, outer: OuterUnit, done: Parallelized, resolved: ResolvedConfig, ranks: RankContext
) -> tuple[SkippedBlockCheck | None, UnusedParameters | None, StandIns | None]:
    """Several ranks: a block a rank skips is refused, unless ``find_unused_parameters`` is set: then the blocks are
    in the outer unit (``True``) or a skipped one is stood in for where it would have run (``"units"``:
    ``stand_ins.py``), and a parameter no rank used is left without a gradient, as DDP's flag does (a collective per
    backward). Either way a parameter a rank leaves unused is reduced as zeros (``steps.apply_fsdp``; the norms
    here). One rank sends no collective to mismatch: nothing to watch."""
    if ranks.world_size == 1:
        return None, None, None
    if done.norms is not None:
        done.norms.zero_unused = True
    blocks = [(name, module.get_submodule(name)) for name in done.plan.block_names]
    if not resolved.sharding.find_unused_parameters:
        return (SkippedBlockCheck(blocks, ranks.rank, ranks.world_size) if blocks else None), None, None
    in_units = [(name, block) for name, block in blocks if isinstance(block, FSDPModule)]
    stand_ins = StandIns(in_units, outer) if in_units else None
    if stand_ins is not None:
        done.plan.notes.append(
            f"find_unused_parameters=\"units\": a block a rank skips ({len(in_units)} in units) is called as an"
            " identity where it would have run, so that its unit's collectives pair with the other ranks'")
    units = [unit for unit in outer.modules() if isinstance(unit, FSDPModule)]
    return None, UnusedParameters([(unit, outer_unit_parameters(unit)) for unit in units], done.norms), stand_ins


def _note_without_gradient(summary: SetupSummary, names: tuple[str, ...]) -> None:
    """Several ranks reduce a zero gradient for a parameter this rank did not use (``zero_gradients_for_unused``): one
    no rank used then holds zeros, which an optimizer's decay and momentum still act on, where DDP's
    ``find_unused_parameters=True`` (the flag DDP needs for such a model) leaves it none and the optimizer skips it."""
    note = (f"{len(names)} trainable parameter(s) got no gradient in the step measured at setup"
            f" ({abbreviated(names)}): in a step where no rank uses them they get a zero gradient (an optimizer"
            " holding them still applies weight decay and momentum), where DDP"
            " (strategy='ddp_find_unused_parameters_true') leaves them none and the optimizer skips them. Pass"
            " VitScaleStrategy(find_unused_parameters=True) for DDP's behaviour (one small collective per backward),"
            " or freeze them (requires_grad_(False)) if they never train")
    summary.notes.append(note)
    rank_zero_warn(f"VitScaleStrategy: {note}.")


def _note_full_precision(summary: SetupSummary, calls: Calls, compute: torch.dtype) -> None:
    # The modules named, where they or layers inside them are kept (a parametrized head holds its weight in a child)
    kept = sorted(name for name in calls.full_precision
                  if any(m == name or m.startswith(f"{name}.") for m in summary.fp32_modules))
    if kept:
        summary.notes.append(
            f"{len(kept)} module(s) the step runs inside its own `torch.autocast(..., enabled=False)` kept in fp32"
            f" beside the norms, as DDP's AMP computes them: {abbreviated(kept)}")
    if calls.kept_fp32:
        by_error: dict[str, list[str]] = {}
        for name, error in calls.kept_fp32.items():
            by_error.setdefault(error, []).append(name)
        named = "; ".join(f"{abbreviated(names)} ({error})" for error, names in by_error.items())
        summary.notes.append(f"{len(calls.kept_fp32)} module(s) whose own code raised with their weights in"
                             f" {str(compute)[6:]} kept in fp32 beside the norms, as DDP's AMP keeps its weights:"
                             f" {named}")


def _describe_layout(
    summary: SetupSummary, outer: nn.Module, norms: ReplicatedNorms | None, precision: PrecisionPolicy,
    sharding: ShardingPolicy, ranks: RankContext, tensor_sent: float | None = None,
) -> None:
    """Sharding layout, per-step traffic and offload in the summary."""
    mesh = ranks.sharding_mesh
    tp = ranks.tensor_mesh.size() if ranks.tensor_mesh is not None else 1
    summary.layout = layout_report(
        outer, norms.params if norms is not None else [], precision, sharding.reshard_after_forward, mesh.size(),
        shard_size(mesh), ranks.ranks_per_node, ranks.rank // tp, tp, tensor_sent,
    )
    if sharding.offload is not None:
        no_effect = " (no effect on accelerator='cpu': the state already lives in host memory)"
        summary.offload = sharding.offload + (no_effect if ranks.device.type == "cpu" else "")

