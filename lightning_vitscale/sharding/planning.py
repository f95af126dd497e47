"""What the planner decides before the pipeline runs, from the batch known at setup: ``"auto"``'s plan (else a
meta twin waits for the first batch) or, for checkpointing the user chose, what ``priority`` left to it. Every
rank keeps to the smallest budget (:func:`agreed_budget`) and applies rank 0's plan. Then: how it is applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._utils import human_bytes
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.distributed import RankContext
from lightning_vitscale.distributed.mesh import shard_size
from lightning_vitscale.memory import (
    AutoCheckpointing,
    Measurement,
    ModeOf,
    PlanningBatch,
    StepInputs,
    StepSettings,
    describe_prediction,
    device_memory,
    planning_batch,
    rates_for,
    resolve_budget,
)
from lightning_vitscale.memory.plan_search import BlockPlan, SearchSpace, least_memory, search
from lightning_vitscale.precision import PrecisionPolicy
from lightning_vitscale.sharding.activation_checkpointing import is_self_checkpointing
from lightning_vitscale.sharding.batchless_units import (
    NO_BATCH,
    UNMEASURED,
    offloads,
    one_rank_keeps,
    recipe_units,
    several_ranks_units,
)
from lightning_vitscale.sharding.resolved import ResolvedConfig
from lightning_vitscale.sharding.summary import SetupSummary


@dataclass(frozen=True)
class Planned:
    """The settings to shard with (the planner's choices in) and what to apply once the units exist: ``auto``'s
    lifecycle (``None``: off), the setup's measurement for the summary and what it ran on, what the measured step
    called (the units are what it runs), why nothing was measured."""

    resolved: ResolvedConfig
    budget: int
    auto: AutoCheckpointing | None = None
    measured: StepInputs | None = None
    measured_on: str = ""
    units_choice: str | None = None
    kept_gathered: tuple[str, ...] = ()
    calls: Calls | None = None
    unmeasured: str = ""
    keeps_every_unit: bool = False  # one rank, no batch at setup: every block in the outer unit (one_rank_keeps)

    def tensor_sent(self, summary: SetupSummary) -> float | None:
        """Bytes this rank sends per step over the tensor-parallel dimension (activations' all-reduces, predicted
        for the planner's batch and the checkpointing applied); ``None`` without one or a batch at setup."""
        if self.auto is not None:
            plan = self.auto.choice.plan if self.auto.choice is not None else None
            return None if plan is None else plan.traffic.get("tensor_parallel")
        inputs = self.measured
        if inputs is None or inputs.tensor is None:
            return None
        modes = ["selective" if b.name in summary.selective else "full" if b.name in summary.checkpointed else None
                 for b in inputs.profile.blocks]
        return inputs.tensor.sent(modes, inputs.batch_scale)

    def step(self, module: nn.Module) -> tuple[StepInputs, StepSettings] | None:
        """The measured step and the settings setup applies (``kernels="auto"`` predicts from them), if measured."""
        if self.auto is not None:
            plan = self.auto.choice.plan if self.auto.choice is not None else None
            return None if plan is None or plan.inputs is None else (plan.inputs, plan.chosen.settings)
        if self.measured is None:
            return None
        names = [block.name for block in self.measured.profile.blocks]
        modes = [self.resolved.checkpoint_mode(i, name, module.get_submodule(name)) for i, name in enumerate(names)]
        return self.measured, StepSettings(
            checkpointed=frozenset(i for i, mode in enumerate(modes) if mode is not None),
            reshard_after_forward=self.resolved.sharding.reshard_after_forward is not False,
            selective=frozenset(i for i, mode in enumerate(modes) if mode == "selective"),
            kept_gathered=frozenset(i for i, name in enumerate(names) if name in self.kept_gathered),
            blocks_per_unit=self.resolved.blocks_per_unit,
        )

    @property
    def kept_at_setup(self) -> tuple[str, ...]:
        """The blocks whose units are kept gathered, as known before the pipeline (``"auto"`` may decide later)."""
        if self.auto is not None:
            return tuple(self.auto.choice.kept_gathered) if self.auto.choice is not None else ()
        return self.kept_gathered

    def apply(self, module: nn.Module, summary: SetupSummary, device: torch.device) -> None:
        """After the pipeline: blocks kept gathered where the planner chose so; the summary's memory lines."""
        if self.units_choice is not None:
            summary.units_choice = self.units_choice
        if self.unmeasured:
            units = "units from their sizes alone" if self.units_choice else "units from the model's structure alone"
            summary.memory = f"no prediction, {units}: {self.unmeasured}"
        if self.auto is not None:
            apply_auto_choice(module, self.auto, summary)
        elif self.measured is not None:
            keep_gathered(module, self.kept_gathered)
            resolved = self.resolved
            reshard = resolved.sharding.reshard_after_forward is not False
            summary.predicted_peak, summary.memory = describe_prediction(
                self.measured, summary.checkpointed, reshard, offloads(resolved.sharding, device), summary.selective,
                resolved.blocks_per_unit, self.kept_gathered, self.measured_on, self.budget,
            )


def plans_from_batch(resolved: ResolvedConfig) -> bool:
    """Whether the planner chooses anything from a batch (so that setup should find one in the training data)."""
    return resolved.checkpointing.is_auto or resolved.planner_units or resolved.planner_keeps


def agreed_budget(memory_budget: int | float | None, ranks: RankContext) -> int:
    """``memory_budget`` in bytes, resolved once per setup: the smallest any rank resolved (free host memory differs
    by rank), so that every rank's search, on the same batch shape, finds the same plan, one that fits on all."""
    return -ranks.agree_max(-resolve_budget(memory_budget, device_memory(ranks.device, ranks.ranks_per_node)))


def plan_before_sharding(
    module: nn.Module, resolved: ResolvedConfig, precision: PrecisionPolicy, ranks: RankContext, budget: int,
    batch: PlanningBatch | None = None, trainer: pl.Trainer | None = None,
) -> Planned:
    """The planner's part of setup, before any unit exists (every rank calls it: it agrees by collectives).
    ``batch``: what it measures (``None``: ``example_input_array`` if set); ``trainer``: whose loop the step runs in."""
    sharding, shard = resolved.sharding, shard_size(ranks.sharding_mesh)
    replicas = ranks.sharding_mesh.size() // shard  # copies of a shard group (hybrid), as the layout report counts
    tp = ranks.tensor_mesh.size() if ranks.tensor_mesh is not None else 1  # it measures one TP rank's share
    measure = Measurement(shard, precision.name, sharding.blocks, replicas, tp, sharding.tensor_plan, trainer,
                          order=None if sharding.units_in_call_order else ())
    if resolved.checkpointing.is_auto:
        auto = AutoCheckpointing(
            budget, measure, _fixed_reshard(resolved), offloads(sharding, ranks.device),
            blocks_per_unit=None if resolved.planner_units else resolved.blocks_per_unit,
            required=resolved.requested.checkpointing.blocks == "auto", measures=ranks.is_rank_zero,
        )
        choice = auto.at_setup(module, ranks.device, ranks.broadcast, batch)
        if choice is not None:  # else decided at the first training step, from its batch
            units: str | None = None
            one_unit = False
            if choice.plan is None:  # not measured: the recipe's checkpointing, in a batchless run's units
                blocks, units, one_unit = recipe_units(module, resolved, precision, ranks, budget, choice.blocks)
                choice = auto.choice = dataclasses.replace(choice, blocks=blocks)
            resolved = dataclasses.replace(resolved, checkpoint_choice=choice.modes,
                                           blocks_per_unit=choice.blocks.per_unit)
            return Planned(resolved, budget, auto, calls=measure.calls, units_choice=units, keeps_every_unit=one_unit)
        keeps = one_rank_keeps(module, resolved, precision, ranks, budget)
        if keeps is not None:
            auto.fixed_reshard = False  # the first step's plan: every block's parameters kept from forward to backward
            auto.units_left_to_planner = False  # one unit: no hint for other units
            return Planned(resolved, budget, auto, calls=measure.calls, units_choice=keeps, keeps_every_unit=True)
        resolved, grouped = several_ranks_units(module, resolved, precision, ranks, budget)
        auto.blocks_per_unit = resolved.blocks_per_unit if grouped else auto.blocks_per_unit
        return Planned(resolved, budget, auto, calls=measure.calls, units_choice=grouped)
    batch, calls = batch or planning_batch(module, None), measure.calls
    measured, measured_on = (None, "") if batch is None else measure.or_why(
        module, batch, ranks.device, _mode_of(module, resolved))
    if measured is None:  # no batch, or a step fake tensors cannot follow: the units from their sizes alone
        why = NO_BATCH if batch is None else UNMEASURED
        keeps = one_rank_keeps(module, resolved, precision, ranks, budget, why)
        if keeps is not None:
            return Planned(resolved, budget, calls=calls, units_choice=keeps, keeps_every_unit=True,
                           unmeasured=measured_on)
        resolved, grouped = several_ranks_units(module, resolved, precision, ranks, budget, why)
        return Planned(resolved, budget, calls=calls, units_choice=grouped, unmeasured=measured_on)
    if not (resolved.planner_units or resolved.planner_keeps):
        return Planned(resolved, budget, measured=measured, measured_on=measured_on, calls=calls)
    resolved, line, kept = _choose_units(module, resolved, measured, ranks, budget)
    return Planned(resolved, budget, measured=measured, measured_on=measured_on, units_choice=line,
                   kept_gathered=kept, calls=calls)


def _mode_of(module: nn.Module, resolved: ResolvedConfig) -> ModeOf:
    """Modes asked of ``module``'s own blocks: the measurement may run on a meta twin a user's predicate never saw."""
    return lambda index, name, _: resolved.checkpoint_mode(index, name, module.get_submodule(name))


def _choose_units(
    module: nn.Module, resolved: ResolvedConfig, measured: StepInputs, ranks: RankContext, budget: int
) -> tuple[ResolvedConfig, str, tuple[str, ...]]:
    """The blocks per unit and units kept gathered ``priority`` left to the planner, for the checkpointing chosen."""
    names = [block.name for block in measured.profile.blocks]
    space = SearchSpace(
        measured, budget, rates_for(ranks.device), offloads(resolved.sharding, ranks.device), _fixed_reshard(resolved),
        per_unit=None if resolved.planner_units else resolved.blocks_per_unit,
        modes=tuple(resolved.checkpoint_mode(i, name, module.get_submodule(name)) for i, name in enumerate(names)),
    )
    plan = ranks.broadcast(search(space))
    kept = tuple(names[plan.resharded:]) if plan.kept_units else ()
    return dataclasses.replace(resolved, blocks_per_unit=plan.per_unit), _units_line(space, plan), kept


def _units_line(space: SearchSpace, plan: BlockPlan) -> str:
    """The setup summary's reason for the units: what the plan saves against the least-memory units, its peak."""
    base = least_memory(space)
    if plan == base:
        return f"planner: no larger unit fits {human_bytes(space.budget)} or saves time"
    kept = f", {plan.kept_units} of {plan.units} units kept gathered for backward" if plan.kept_units else ""
    return (f"planner{kept}: predicted {(space.seconds(base) - space.seconds(plan)) * 1e3:.1f} ms per step less than"
            f" {base.units} units of {base.per_unit} ({base.kept_units} kept), peak {human_bytes(space.peak(plan))}"
            f" of {human_bytes(space.budget)}")


def _fixed_reshard(resolved: ResolvedConfig) -> bool | None:
    """Every block unit's reshard as pinned (``True`` also for a smaller world size), or ``None``: the planner's."""
    return None if resolved.planner_keeps else resolved.sharding.reshard_after_forward is not False


def apply_auto_choice(module: nn.Module, auto: AutoCheckpointing, summary: SetupSummary) -> None:
    """``"auto"``'s choice applied to the units (see :func:`keep_gathered`) and put into the summary."""
    choice = auto.choice
    own = []  # blocks the model checkpoints itself: the plan may name them, the pipeline leaves them to the model
    if choice is not None:
        own = [name for name in choice.names if is_self_checkpointing(module.get_submodule(name))]
        summary.checkpointed = [name for name in choice.names if name not in own]
        summary.selective = [name for name, mode in choice.modes.items() if mode == "selective" and name not in own]
        summary.predicted_peak = choice.plan.chosen.breakdown.peak if choice.plan is not None else None
        keep_gathered(module, choice.kept_gathered)
    summary.memory = auto.describe() + (f"; {len(own)} of the blocks it checkpoints do so themselves (left as the"
                                        " model set them)" if own else "")


def keep_gathered(module: nn.Module, names: Sequence[str]) -> None:
    """The units of blocks ``names`` keep their gathered parameters from forward to backward (one all-gather fewer)."""
    for name in names:
        block = module.get_submodule(name)
        if isinstance(block, FSDPModule):  # else in the outer unit (one rank), never resharded after forward
            block.set_reshard_after_forward(False, recurse=False)
