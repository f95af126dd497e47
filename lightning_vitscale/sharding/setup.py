"""Sharding a LightningModule once (the strategy's ``setup``: :func:`shard_lightning_module`, in order), reused by a
later Trainer only under the same settings; :class:`ShardedModel`, its result: what the steps still need from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import initialize_fsdp_root, set_lightning_device
from lightning_vitscale._utils import human_bytes
from lightning_vitscale.checkpoint import full_state_dict
from lightning_vitscale.distributed import RankContext
from lightning_vitscale.distributed.mesh import shard_size
from lightning_vitscale.init import Creation
from lightning_vitscale.kernels import (
    AttentionRouter,
    KernelPolicy,
    apply_regional_compile,
    auto_attention_step,
)
from lightning_vitscale.memory import (
    AccumulationChoice,
    AccumulationMode,
    AutoCheckpointing,
    PlanningBatch,
    StepInputs,
    StepSettings,
    batch_size_of,
    choose_accumulation,
    planning_batch,
    release_gradients,
)
from lightning_vitscale.precision import (
    PrecisionPolicy,
    ReplicatedNorms,
    VitScalePrecision,
    flat_step,
    lightning_grad_norm_named,
    refuse_unshardable,
)
from lightning_vitscale.sharding import plain_copy
from lightning_vitscale.sharding.activation_checkpointing import (
    CHECKPOINT_MODES,
    apply_activation_checkpointing,
    mark_parent_checkpointing,
)
from lightning_vitscale.sharding.buffer_sync import BufferSync
from lightning_vitscale.sharding.gradient_sync import gradient_sync_off, unsharded_gradient_bytes
from lightning_vitscale.sharding.mixed_tensors import mixed_tensors_named
from lightning_vitscale.sharding.outer_unit import OuterUnit, SecondBackwardError, outer_unit_parameters, reshard_units
from lightning_vitscale.sharding.parallelize import Parallelized, parallelize, refuse_unshardable_parameters
from lightning_vitscale.sharding.parameter_writes import make_parameters_assignable
from lightning_vitscale.sharding.planning import (
    agreed_budget,
    apply_auto_choice,
    plan_before_sharding,
    plans_from_batch,
)
from lightning_vitscale.sharding.refused_callbacks import refuse_unshardable_callbacks
from lightning_vitscale.sharding.resolved import (
    ResolvedConfig,
    compile_at_first_step,
    compile_choice,
    compile_where_it_pays,
)
from lightning_vitscale.sharding.settings import ParallelConfig, ShardingPolicy
from lightning_vitscale.sharding.skipped_blocks import SkippedBlockCheck, UnusedParameters
from lightning_vitscale.sharding.summary import SetupSummary
from lightning_vitscale.sharding.traffic import layout_report

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


class PlannedStepOutOfMemoryError(torch.OutOfMemoryError):
    """The device ran out of memory in a step planned for speed: the planner's prediction was wrong for this run.
    A ``torch.OutOfMemoryError`` still (its text included), so handlers of the original keep working."""


@dataclass
class ShardedModel:
    """A LightningModule sharded by the recipe, and the hooks its steps call.

    Attributes:
        outer: the outer FSDP unit around the module: what Lightning calls (``strategy.model``).
        norms: the fp32 norms outside the units, whose gradients are averaged after each backward.
        auto: ``activation_checkpointing="auto"``: its choice, or the meta twin waiting for the first batch.
        planned_for_speed: ``priority="speed"``'s planner chose (an out-of-memory step then names the fixes).
        accumulation: whether micro-batches before the last skip the gradient sync; chosen at the first one.
    """

    outer: OuterUnit
    summary: SetupSummary
    norms: ReplicatedNorms | None
    router: AttentionRouter | None
    auto: AutoCheckpointing | None
    signature: dict[str, Any]
    memory_budget: int
    planned_for_speed: bool = False
    accumulation: AccumulationChoice | None = None
    backwards_in_step: int = 0  # backwards through the strategy since the training step began
    skipped: SkippedBlockCheck | None = None  # several ranks: a block a rank skips is refused
    unused: UnusedParameters | None = None  # several ranks: parameters no rank used keep no gradient
    # kernels="auto" without a batch at setup: the policy the blocks compile with once a step's plan predicts it pays
    # (decided at the first step, then again at the first step of each larger batch), and the largest batch decided
    # for (0: the first step has not decided yet).
    compile_with: KernelPolicy | None = None
    compile_decided_at: int = 0
    # The module's parameters as setup left them (the DTensors optimizers step; in a step the modules may hold
    # gathered copies instead), and before a backward the frozen ones' gradients (FSDP2's path).
    parameters: list[nn.Parameter] = dataclasses.field(default_factory=list)
    _frozen_gradients: list[tuple[nn.Parameter, torch.Tensor | None]] = dataclasses.field(default_factory=list)

    @property
    def module(self) -> nn.Module:
        return self.outer.module

    def before_training_step(self, batch: Any, ranks: RankContext, optimizers: list[torch.optim.Optimizer]) -> None:
        """``activation_checkpointing="auto"`` without a batch at setup: decide from the first batch, then checkpoint
        the chosen blocks in place (inside their FSDP hooks, as when applied before ``fully_shard``)."""
        if batch is not None and self.compile_with is not None and self.compile_decided_at:
            self._compile_if_the_batch_grew(batch, ranks.device)
        if batch is None or self.auto is None or not self.auto.pending:
            return
        modes = self.auto.at_first_step(batch, ranks.device, ranks.broadcast, optimizers).modes
        for mode in CHECKPOINT_MODES:
            apply_activation_checkpointing([self.module.get_submodule(n) for n, m in modes.items() if m == mode], mode)
        apply_auto_choice(self.module, self.auto, self.summary)
        rank_zero_info(f"VitScaleStrategy activation checkpointing {self.summary.memory}")
        if self.compile_with is not None:  # after checkpointing, as at setup: the recompute is traced too
            self._compile_where_it_pays(self.compile_with, ranks.device)

    def _compile_where_it_pays(self, kernels: KernelPolicy, device: torch.device) -> None:
        """``kernels="auto"`` without a batch at setup: the blocks compiled now, before their first call, where the
        first step's plan predicts it pays (the rule setup applies with a batch: ``compile_where_it_pays``); a step
        the planner could not measure keeps ``"auto"``'s default (compiled). Every rank applies the same plan."""
        measured = self._first_step_measured()
        pays, why = compile_choice(None if measured is None else measured[:2], device)
        self._compile_blocks(kernels, pays, f"{why}; decided at the first training step")
        if pays or measured is None:
            self.compile_with = None
        else:  # eager for now: decided again at a larger batch
            self.compile_decided_at = measured[2]

    def _compile_if_the_batch_grew(self, batch: Any, device: torch.device) -> None:
        """A batch larger than any the blocks were left eager for (a batch ramp-up, a benchmark's larger phase):
        the rule again, on the first step's plan scaled to it; compiled from here where it now pays (the step turns
        device-bound: ViT-H/14 on one H200 at batch 32 compiled ran 0.75x eager, at 336 1.18x). Never uncompiled."""
        try:
            size = batch_size_of(batch)
        except ValueError:
            return
        measured = self._first_step_measured()
        if size <= self.compile_decided_at or measured is None or self.compile_with is None:
            return
        self.compile_decided_at = size
        inputs, settings, planned_batch = measured
        scaled = dataclasses.replace(inputs, batch_scale=inputs.batch_scale * size / planned_batch)
        pays, why = compile_choice((scaled, settings), device)
        if pays:
            self._compile_blocks(self.compile_with, True, f"{why}; decided at the first step of batch {size}")
            self.compile_with = None

    def _first_step_measured(self) -> tuple[StepInputs, StepSettings, int] | None:
        """The step the first step's plan measured, the settings it chose and the batch it measured, if any."""
        plan = self.auto.choice.plan if self.auto is not None and self.auto.choice is not None else None
        return None if plan is None or plan.inputs is None else (plan.inputs, plan.chosen.settings, plan.batch_size)

    def _compile_blocks(self, kernels: KernelPolicy, pays: bool, why: str) -> None:
        blocks = [self.module.get_submodule(name) for name in self.summary.block_names]
        named = "off"
        if pays and blocks:
            apply_regional_compile(blocks, kernels.compile_mode, kernels.compiler)
            named = ", ".join(f"{name} x{count}" for name, count in self.summary.blocks.items())
        self.summary.kernels["compiled blocks"] = f"{named} ({why})"
        rank_zero_info(f"VitScaleStrategy compiled blocks: {self.summary.kernels['compiled blocks']}")

    def take_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[str]:
        """An optimizer that cannot step the shards refused (``precision/optimizer_probe.py``); one rank computing on
        copies: elementwise param groups stepped as one flat tensor each (``precision/flat_step.py``), their
        gradients handed over into its layout. Returns the summary's notes."""
        refuse_unshardable(optimizers)
        copies = self.outer.compute_copies
        if copies is None:
            return []
        groups = flat_step.lay_out(optimizers, copies.params)
        copies.use_flat_gradients(groups)
        return flat_step.describe(groups)

    def training_step(self, step: Callable[[], Any], mean_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """Run ``step`` (an out-of-memory error and a second backward's freed storage named); under
        ``attention="auto"`` the first steps time the kernels."""
        self.backwards_in_step = 0
        if self.skipped is not None:
            self.skipped.reset()
        with self.step_errors_named(), self.second_backward_named():
            return auto_attention_step(self.router, step, mean_over_ranks, self._attention_decided)

    @contextmanager
    def step_errors_named(self) -> Generator[None, None, None]:
        """A step planned for speed that runs out of memory raises :class:`PlannedStepOutOfMemoryError`; Lightning's
        ``grad_norm`` on the sharded gradients (in a step, a hook, a callback) an error naming ours; a step mixing a
        sharded parameter with a plain tensor, one naming the fix (``mixed_tensors.py``)."""
        try:
            with lightning_grad_norm_named(), mixed_tensors_named():
                yield
        except torch.OutOfMemoryError as error:
            if not self.planned_for_speed or isinstance(error, PlannedStepOutOfMemoryError):
                raise
            peak = human_bytes(self.summary.predicted_peak) if self.summary.predicted_peak else "not predicted"
            raise PlannedStepOutOfMemoryError(
                f"{error}\nVitScaleStrategy planned this step for speed within memory_budget ="
                f" {human_bytes(self.memory_budget)} per rank (predicted peak {peak}: {self.summary.memory}), and the"
                " device ran out of memory: the prediction was wrong for this run. Pass"
                " VitScaleStrategy(priority=\"memory\") for the recipe's memory-first plan (every block checkpointed,"
                f" its own FSDP unit, resharded after forward), or leave headroom with a smaller budget, e.g."
                f" memory_budget={int(self.memory_budget * 0.8)} (bytes)."
            ) from error

    def _attention_decided(self, line: str) -> None:
        self.summary.kernels["attention"] = line

    def before_backward(self) -> None:
        """A rank that skipped a block raises before it sends a gradient (``skipped_blocks.py``); a backward inside
        the step (manual optimization) frees the gathered outer unit: the step's writes to it are carried first."""
        if self.outer._in_step:
            self.outer.carry_writes()
        if self.outer.compute_copies is None:  # FSDP2 reduces every gathered gradient, a frozen parameter's too
            self._frozen_gradients = [(p, p.grad) for p in self.parameters if not p.requires_grad]
        if self.skipped is not None:
            self.skipped.before_backward()

    def after_backward(self) -> None:
        self.backwards_in_step += 1
        # A parameter frozen during the step (`toggle_optimizer`, after its unit was gathered) keeps the gradient it
        # had, as under DDP, not the one FSDP2 reduced from its gathered copy.
        for param, grad in self._frozen_gradients:
            if param.grad is not grad:
                param.grad = grad
        self._frozen_gradients = []
        # fp32 norms live outside FSDP's units: their gradients are averaged once per synced backward.
        if self.norms is not None:
            self.norms.after_backward()
        if self.unused is not None:  # after the norms': they reduce zeros for the unused
            self.unused.after_backward()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, release_gradients_now: bool) -> None:
        """``release_gradients_now``: nothing reads the gradients after the step (``memory/gradient_release.py``)."""
        self.outer.release()  # a copy gathered by a callback before the update is stale now
        if release_gradients_now:
            release_gradients(optimizer)
        if self.unused is not None:
            self.unused.after_optimizer_step()

    @contextmanager
    def second_backward_named(self) -> Generator[None, None, None]:
        """Torch's "out of bounds for storage of size 0" from a second ``manual_backward`` in a training step on
        FSDP2's path, which freed the gathered parameters the kept graph saved at the end of the first (one rank
        computing on copies keeps them: ``compute_copies.py``), raised as :class:`SecondBackwardError`."""
        try:
            yield
        except RuntimeError as error:
            fsdp_path = self.outer.compute_copies is None
            if not (fsdp_path and self.backwards_in_step and "storage of size 0" in str(error)):
                raise
            raise SecondBackwardError(
                f"{error}\nA second backward through a graph kept with `retain_graph=True` in the same"
                " `training_step` is not supported by VitScaleStrategy where FSDP2 runs the step (several ranks, or"
                " one rank with several units): FSDP2 freed the gathered parameters that graph saved at the end of"
                " the first backward (DDP has no such state). Call `manual_backward` once on the sum of the losses"
                " (`self.manual_backward(loss_a + loss_b)`: the same gradients), or train this module with"
                " strategy='ddp'."
            ) from error

    @contextmanager
    def accumulating(
        self, mode: AccumulationMode, ranks: RankContext, compute: torch.dtype
    ) -> Generator[None, None, None]:
        """A micro-batch before the last of an accumulation window (Lightning's ``block_backward_sync``): skip
        the gradient sync where :attr:`accumulation` says so. Every rank enters it at the same micro-batch, so
        ``"auto"`` may agree on its choice with a collective the first time."""
        if self.accumulation is None:
            self.accumulation = self._choose_accumulation(mode, ranks, compute)
            self.summary.accumulation = self.accumulation.describe()
            rank_zero_info(f"VitScaleStrategy {self.summary.accumulation}")
        buffers = self.outer.buffer_sync.gradients_unsynced() if self.outer.buffer_sync else nullcontext()
        if not self.accumulation.unsharded:
            with buffers:  # DDP's no_sync, whatever is done with the gradients here
                yield
            return
        if self.norms is not None:
            self.norms.syncing = False
        try:
            with gradient_sync_off(self.outer), buffers:
                yield
        finally:
            if self.norms is not None:
                self.norms.syncing = True

    def _choose_accumulation(
        self, mode: AccumulationMode, ranks: RankContext, compute: torch.dtype
    ) -> AccumulationChoice:
        device = ranks.device
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        in_use = max(self.summary.predicted_peak or 0, measured)
        extra = unsharded_gradient_bytes(self.module, compute)
        choice = choose_accumulation(mode, extra, in_use, self.memory_budget)
        if mode == "auto" and ranks.agree_max(0 if choice.unsharded else 1):  # every rank must fit
            return AccumulationChoice(False, choice.reason.replace("fits", "fits here but not on every rank"))
        return choice

    def reshard(self) -> None:
        """Back to the shards after an evaluation loop: FSDP2 keeps the outer unit and the units kept gathered for
        backward gathered after forward, for a backward that never comes."""
        self.outer.release()
        reshard_units(self.outer)


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
    sharded: ShardedModel | None = module.__dict__.get(_SHARDED_ATTR)
    if sharded is None:
        batch = planning_batch(module, fitting)
        sharded = module.__dict__[_SHARDED_ATTR] = _shard(module, resolved, precision, ranks, creation, signature,
                                                          batch, trainer)
        rank_zero_info(sharded.summary.summary())
    check_reusable(sharded.signature, signature)
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
    mark_parent_checkpointing(module)  # before the planner: its blocks are the model's to checkpoint
    # 1. Master weights in the master dtype (norms keep theirs). No `module.to(device)`: FSDP moves each unit's
    #    shards to the device as it shards the unit, so no rank ever holds the whole model on the device.
    module = precision.convert_module(module)
    forwards = plain_copy.record_forwards(module)  # before checkpointing, compilation and routing wrap some
    outer = OuterUnit(module)
    # 2. The planner decides before the pipeline what it can from the batch, if known (example_input_array, or
    #    one batch of the training data): "auto" checkpointing, blocks per unit, units kept gathered. It measures
    #    the plain module (or its meta twin): once sharded, running it would gather.
    budget = agreed_budget(resolved.checkpointing.memory_budget, ranks)  # once: every choice by memory keeps to it
    planned = plan_before_sharding(module, resolved, precision.policy, ranks, budget, batch, trainer)
    planned = dataclasses.replace(planned, resolved=compile_where_it_pays(planned.resolved, planned.step(module),
                                                                          ranks.device))
    pending = planned.auto is not None and planned.auto.pending  # the plan waits for the first training batch
    resolved_now, compile_with = compile_at_first_step(planned.resolved, pending)
    planned = dataclasses.replace(planned, resolved=resolved_now)
    # 3. The recipe: norms, casts, attention routing, checkpointing, compile, block units, the outer unit.
    done = parallelize(
        outer, module, ranks.sharding_mesh, planned.resolved, precision.policy, ranks.device, creation,
        tensor_mesh=ranks.tensor_mesh, calls=planned.calls, kept_gathered=planned.kept_at_setup,
        keep_every_unit=planned.keeps_every_unit,
    )
    set_lightning_device(module, ranks.device)
    if planned.keeps_every_unit and planned.auto is not None:  # the first step's plan: the one unit made
        planned.auto.blocks_per_unit = max(1, len(done.plan.block_names))
    planned.apply(module, done.plan, ranks.device)
    # After the planner's choices are applied: units it keeps gathered send no all-gather in backward.
    _describe_layout(done.plan, outer, done.norms, precision.policy, resolved.sharding, ranks,
                     planned.tensor_sent(done.plan))
    # 4. Drop-in behaviour: calls outside a step gather the outer unit; state_dict() gives DDP's full tensors.
    outer.enable_calls_outside_steps()
    make_parameters_assignable(module)  # `p.data = v` writes into the shard, as it does into DDP's parameter
    full_state_dict.install(module, outer)
    plain_copy.install(forwards, outer)  # copy.deepcopy(model): DDP's plain module, whole parameters
    # 5. FSDP's root fixed now, not at the first forward: a hook may call the model or any child before the first
    #    step, as under DDP. Every unit exists and holds real (not meta) shards by here.
    if isinstance(outer, FSDPModule):
        initialize_fsdp_root(outer)
    speed = plans_from_batch(resolved) and resolved.requested.priority == "speed"
    skipped, unused = _skipped_blocks(module, outer, done, resolved, ranks)
    return ShardedModel(outer, done.plan, done.norms, done.router, planned.auto, signature, budget,
                        planned_for_speed=speed, skipped=skipped, unused=unused, compile_with=compile_with,
                        parameters=list(module.parameters()))


def _skipped_blocks(
    module: nn.Module, outer: OuterUnit, done: Parallelized, resolved: ResolvedConfig, ranks: RankContext
) -> tuple[SkippedBlockCheck | None, UnusedParameters | None]:
    """Several ranks: a block a rank skips is refused, unless ``find_unused_parameters=True`` keeps every block in
    the outer unit and leaves a parameter no rank used without a gradient, as DDP's flag does (a collective per
    backward). Either way a parameter a rank leaves unused is reduced as zeros (``steps.apply_fsdp``; the norms
    here). One rank sends no collective to mismatch: nothing to watch."""
    if ranks.world_size == 1:
        return None, None
    if done.norms is not None:
        done.norms.zero_unused = True
    if not resolved.sharding.find_unused_parameters:
        blocks = [(name, module.get_submodule(name)) for name in done.plan.block_names]
        return (SkippedBlockCheck(blocks, ranks.rank, ranks.world_size) if blocks else None), None
    units = [unit for unit in outer.modules() if isinstance(unit, FSDPModule)]
    return None, UnusedParameters([(unit, outer_unit_parameters(unit)) for unit in units], done.norms)


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

