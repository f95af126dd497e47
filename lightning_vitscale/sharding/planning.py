"""What the planner decides before the pipeline runs, from the batch when it is known at setup
(``example_input_array``, else one batch of the train dataloader: ``memory/planning_batch.py``):
``activation_checkpointing="auto"``'s plan (else a meta twin waits for the first batch) and, for checkpointing the
user chose, ``blocks_per_unit=None``'s grouping; afterwards, how the choice is applied to the sharded units and
described in the setup summary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.distributed.mesh import shard_size
from lightning_vitscale.memory import (
    AutoCheckpointing,
    ModeOf,
    PlanningBatch,
    StepInputs,
    StepSettings,
    agree_on_unit_size,
    choose_blocks_per_unit,
    describe_prediction,
    device_memory,
    measure_for_summary,
    planning_batch,
    rates_for,
    resolve_budget,
)
from lightning_vitscale.precision import PrecisionPolicy
from lightning_vitscale.sharding.ranks import Ranks
from lightning_vitscale.sharding.resolved import ResolvedConfig
from lightning_vitscale.sharding.settings import ShardingPolicy
from lightning_vitscale.sharding.summary import SetupSummary


@dataclass(frozen=True)
class Planned:
    """The settings to shard with (the planner's choices filled in) and what to apply once the units exist.

    Attributes:
        resolved: the resolved settings with ``"auto"``'s blocks and the blocks per unit chosen where they could be.
        auto: the ``"auto"`` lifecycle (its choice, or the meta twin waiting for the first batch); ``None`` if off.
        measured: the fake-tensor measurement for the summary's predicted peak (the batch known at setup).
        measured_on: where that batch came from and what ran on it.
        units_choice: why the blocks per unit are what they are, where the planner chose them.
        kept_gathered: blocks whose unit the planner keeps gathered from forward to backward (their units'
            reshard left to it: ``reshard_after_forward=None``).
        budget: ``memory_budget`` in bytes on this rank, resolved once (the grouping kept to it; the summary names
            it, and says so when the predicted peak is over it).
        calls: what the measured step called (the units are what it runs), where a step was measured at setup.
        unmeasured: why the step measured at setup gave no prediction (the summary says it), else empty.
    """

    resolved: ResolvedConfig
    auto: AutoCheckpointing | None = None
    measured: StepInputs | None = None
    measured_on: str = ""
    units_choice: str | None = None
    kept_gathered: tuple[str, ...] = ()
    budget: int | None = None
    calls: Calls | None = None
    unmeasured: str = ""

    def tensor_sent(self, summary: SetupSummary) -> float | None:
        """Bytes this rank sends per step over the tensor-parallel dimension for the checkpointing applied
        (the all-reduces of activations, predicted for the planner's batch); ``None`` without tensor parallelism
        or a batch measured at setup."""
        if self.auto is not None:
            plan = self.auto.choice.plan if self.auto.choice is not None else None
            return None if plan is None else plan.traffic.get("tensor_parallel")
        inputs = self.measured
        if inputs is None or inputs.tensor is None:
            return None
        modes = ["selective" if b.name in summary.selective else "full" if b.name in summary.checkpointed else None
                 for b in inputs.profile.blocks]
        return inputs.tensor.sent(modes, inputs.batch_scale)

    def apply(self, module: nn.Module, summary: SetupSummary, device: torch.device) -> None:
        """After the pipeline: blocks kept gathered where the planner chose so, and the summary's memory lines."""
        if self.units_choice is not None:
            summary.units_choice = self.units_choice
        if self.unmeasured:
            summary.memory = f"no prediction, units from the model's structure alone: {self.unmeasured}"
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


def plan_before_sharding(
    module: nn.Module,
    resolved: ResolvedConfig,
    precision: PrecisionPolicy,
    ranks: Ranks,
    batch: PlanningBatch | None = None,
) -> Planned:
    """The planner's part of setup, before any unit exists (every rank calls it: it agrees by collectives).
    ``batch``: what it measures (``memory.planning_batch``); ``None``: ``example_input_array`` if set."""
    auto, resolved = _auto_checkpointing(module, resolved, precision, ranks, batch)
    if auto is not None:
        return Planned(resolved, auto, calls=auto.calls)
    sharding, calls = resolved.sharding, Calls()
    shard, replicas = _groups(ranks)
    found = measure_for_summary(module, batch or planning_batch(module, None), shard, precision.name,
                                sharding.blocks, ranks.device, _mode_of(module, resolved), replicas,
                                _tensor_parallel(ranks), sharding.tensor_plan, calls)
    if found is None:
        return Planned(resolved)
    measured, measured_on = found
    if measured is None:
        return Planned(resolved, calls=calls, unmeasured=measured_on)
    budget = resolve_budget(resolved.requested.checkpointing.memory_budget,
                            device_memory(ranks.device, ranks.ranks_per_node))
    if sharding.blocks_per_unit is not None:  # the user chose the blocks per unit
        return Planned(resolved, measured=measured, measured_on=measured_on, budget=budget, calls=calls)
    resolved, line, kept = _choose_units(module, resolved, measured, ranks, budget)
    return Planned(resolved, measured=measured, measured_on=measured_on, units_choice=line, kept_gathered=kept,
                   budget=budget, calls=calls)


def _groups(ranks: Ranks) -> tuple[int, int]:
    """The ranks of one shard group and how many copies of it (hybrid sharding), as the layout report counts them."""
    shard = shard_size(ranks.sharding_mesh)
    return shard, ranks.sharding_mesh.size() // shard


def _tensor_parallel(ranks: Ranks) -> int:
    """The ranks that split each block (``tensor_parallel=k``): the planner measures one of them's share."""
    return ranks.tensor_mesh.size() if ranks.tensor_mesh is not None else 1


def _mode_of(module: nn.Module, resolved: ResolvedConfig) -> ModeOf:
    """``resolved.checkpoint_mode`` asked of ``module``'s own block: the measurement may run on a meta twin, whose
    blocks a user's predicate has never seen."""
    return lambda index, name, _: resolved.checkpoint_mode(index, name, module.get_submodule(name))


def _choose_units(
    module: nn.Module, resolved: ResolvedConfig, measured: StepInputs, ranks: Ranks, budget: int
) -> tuple[ResolvedConfig, str, tuple[str, ...]]:
    """``blocks_per_unit=None`` with the batch known at setup: the planner's grouping for the checkpointing the user
    chose, and with ``reshard_after_forward=None`` the units kept gathered. Every rank the same: the fewest blocks
    per unit any rank chose, then the most resharded blocks (the fewest units kept) any rank chose for it."""
    names = [block.name for block in measured.profile.blocks]
    modes = [resolved.checkpoint_mode(i, name, module.get_submodule(name)) for i, name in enumerate(names)]
    sharding = resolved.sharding
    settings = StepSettings(
        checkpointed=frozenset(i for i, mode in enumerate(modes) if mode is not None),
        reshard_after_forward=sharding.reshard_after_forward is not False,
        offload=offloads(sharding, ranks.device),
        selective=frozenset(i for i, mode in enumerate(modes) if mode == "selective"),
    )
    may_keep, rates = sharding.reshard_after_forward is None, rates_for(ranks.device)
    choice = choose_blocks_per_unit(measured, settings, budget, rates, may_keep)
    agreed = agree_on_unit_size(choice, choice.per_unit, lambda k: choose_blocks_per_unit(
        measured, settings, budget, rates, may_keep, per_unit=k), ranks.agree_max)
    per_unit, resharded = agreed.per_unit, ranks.agree_max(agreed.resharded)
    line = choice.describe() if (per_unit, resharded) == (choice.per_unit, choice.resharded) else (
        "planner: the fewest blocks per unit and units kept gathered any rank chose")
    kept = dataclasses.replace(agreed, resharded=resharded).kept_gathered()
    return dataclasses.replace(resolved, blocks_per_unit=per_unit), line, tuple(names[i] for i in sorted(kept))


def offloads(sharding: ShardingPolicy, device: torch.device) -> bool:
    """Whether the sharded state leaves the device (``offload="cpu"`` on a CPU rank changes nothing)."""
    return sharding.offload is not None and device.type != "cpu"


def _auto_checkpointing(
    module: nn.Module,
    resolved: ResolvedConfig,
    precision: PrecisionPolicy,
    ranks: Ranks,
    batch: PlanningBatch | None = None,
) -> tuple[AutoCheckpointing | None, ResolvedConfig]:
    """The ``"auto"`` lifecycle and ``resolved`` with the blocks chosen at setup, if the choice could be made now."""
    requested = resolved.requested
    if not requested.checkpointing.is_auto:
        return None, resolved
    shard, replicas = _groups(ranks)
    auto = AutoCheckpointing(
        requested.checkpointing.memory_budget, shard, precision.name, requested.sharding.blocks,
        may_keep_gathered=requested.sharding.reshard_after_forward is None,
        offload=offloads(requested.sharding, ranks.device),
        blocks_per_unit=requested.sharding.blocks_per_unit, replicas=replicas,
        tensor_parallel=_tensor_parallel(ranks), tensor_plan=requested.sharding.tensor_plan,
    )
    choice = auto.at_setup(module, ranks.device, ranks.ranks_per_node, ranks.agree_max, batch)
    if choice is None:
        return auto, resolved  # decided at the first training step, from its batch
    chosen = dataclasses.replace(resolved, checkpoint_choice=choice.modes, blocks_per_unit=choice.blocks.per_unit)
    return auto, chosen


def apply_auto_choice(module: nn.Module, auto: AutoCheckpointing, summary: SetupSummary) -> None:
    """``"auto"``'s choice applied to the units (see :func:`keep_gathered`) and put into the summary."""
    choice = auto.choice
    if choice is not None:
        summary.checkpointed = choice.names
        summary.selective = [name for name, mode in choice.modes.items() if mode == "selective"]
        summary.predicted_peak = choice.plan.chosen.breakdown.peak
        keep_gathered(module, choice.kept_gathered)
    summary.memory = auto.describe()


def keep_gathered(module: nn.Module, names: Sequence[str]) -> None:
    """The units of blocks ``names`` keep their gathered parameters from forward to backward (one all-gather per
    unit fewer; a unit's FSDP setting, shared by the blocks of a unit)."""
    for name in names:
        block = module.get_submodule(name)
        assert isinstance(block, FSDPModule), f"{name} is not an FSDP unit"
        block.set_reshard_after_forward(False, recurse=False)
