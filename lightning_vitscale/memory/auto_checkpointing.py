"""``activation_checkpointing="auto"`` (``VitScaleStrategy()``'s default): the fastest plan (:mod:`.plan_search`)
that keeps a step in budget, from the batch measured on fake tensors (checkpointing every block costs a third more
compute even where the activations fit). The batch is known at setup (``example_input_array``, a training batch)
or at the first step: then a meta twin is kept from setup (the sharded module's FSDP hooks would all-gather) and
the units, made at setup, are one block each. The sharding setup applies the choice.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_vitscale._utils import available_host_bytes, human_bytes
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.discovery.unit_runs import UnitRuns
from lightning_vitscale.memory.gradient_release import unwrapped
from lightning_vitscale.memory.measurement import Measurement, MeasurementError
from lightning_vitscale.memory.memory_plan import MemoryPlan
from lightning_vitscale.memory.plan_search import BlockMode, BlockPlan, Modes, SearchSpace, fits_unchecked
from lightning_vitscale.memory.planner import batch_size_of, choose, model_parts
from lightning_vitscale.memory.planning_batch import (
    EXAMPLE_INPUT,
    FIRST_STEP,
    PlanningBatch,
    briefly,
    planning_batch,
)
from lightning_vitscale.memory.step_cost import rates_for
from lightning_vitscale.memory.step_inputs import StepInputs, StepSettings
from lightning_vitscale.memory.step_model import predict_step
from lightning_vitscale.memory.twin import meta_twin
from lightning_vitscale.precision import resolve_flag

AgreePlan = Callable[[Any], Any]
"""Every rank gets rank 0's value (``RankContext.broadcast``): its measured outcome, then the plan every rank keeps."""


@dataclass(frozen=True)
class AutoChoice:
    """The plan every rank agreed on (``blocks``, applied) and the plan that chose it: ``None`` where the step could
    not be measured and the default fell back to the recipe's (``warning`` says why)."""

    plan: MemoryPlan | None
    block_names: list[str]
    blocks: BlockPlan
    warning: str | None = None
    hint: str | None = None
    measured: str = EXAMPLE_INPUT  # where the batch came from and how it was run

    @property
    def modes(self) -> dict[str, BlockMode]:
        return {name: mode for name, mode in zip(self.block_names, self.blocks.modes) if mode is not None}

    @property
    def names(self) -> list[str]:
        return list(self.modes)

    @property
    def kept_gathered(self) -> list[str]:
        """Blocks whose unit keeps its gathered parameters from forward to backward."""
        settings = self.blocks.settings()
        return [name for i, name in enumerate(self.block_names) if settings.keeps(i)]

    def describe(self) -> str:
        p = self.plan
        if p is None:
            return f"auto: {self.blocks.describe()} ({self.warning})"
        none = human_bytes(p.none_checkpointed.breakdown.peak)
        ends = (f"every block full {human_bytes(p.all_checkpointed.breakdown.peak)}, none {none}"
                if p.all_checkpointed is not None else "fits with no block checkpointed in every unit layout, so"
                " checkpointing was not measured")
        return (f"auto: {self.blocks.describe()} (measured on {self.measured}),"
                f" predicted peak {human_bytes(p.chosen.breakdown.peak)} per rank"
                f" (budget {human_bytes(p.budget)}; {ends});"
                f" predicted step time it adds {p.extra_seconds * 1e3:.1f} ms (recompute, all-gathers, per unit)")


def device_memory(device: torch.device, local_ranks: int = 1) -> int:
    """One rank's share of the GPU (``set_per_process_memory_fraction``) or of the host's available memory."""
    if device.type == "cuda":
        share = torch.cuda.get_per_process_memory_fraction(device)
        return int(torch.cuda.get_device_properties(device).total_memory * share)
    return (available_host_bytes() or 0) // max(1, local_ranks)


def unmet_budget(plan: MemoryPlan, inputs: StepInputs, offload: bool) -> str | None:
    """The warning for a budget that no choice meets, naming what would fit; ``None`` when the plan fits."""
    if plan.fits:
        return None
    fixes = []
    offloaded = predict_step(inputs, StepSettings(frozenset(range(plan.num_blocks)), offload=True)).peak
    if not offload and offloaded <= plan.budget:  # named only where it is enough on its own
        fixes.append(f"offload='cpu' (predicted {human_bytes(offloaded)})")
    if plan.max_batch:
        fixes.append(f"a per-rank batch of {plan.max_batch} or less")
    fixes += ["more devices", "a larger memory_budget"]
    return (f"activation_checkpointing='auto': no choice fits the memory budget of {human_bytes(plan.budget)} per"
            f" rank; checkpointing every block, predicted peak {human_bytes(plan.chosen.breakdown.peak)} per rank."
            f" To fit, use {', or '.join(fixes)}.")


def _picklable(value: Any) -> bool:
    try:
        return bool(pickle.dumps(value))
    except Exception:  # a recorded argument or an error that cannot travel: each rank measures for itself
        return False


def optimizer_kind(optimizers: list[torch.optim.Optimizer]) -> str:
    """The planner's name for the user's optimizer's state (AdamW, the larger, when unknown)."""
    for inner in map(unwrapped, optimizers):
        if isinstance(inner, torch.optim.SGD):
            momentum = any(group.get("momentum", 0) for group in inner.param_groups)
            return "sgd-momentum" if momentum else "sgd"
    return "adamw"


@dataclass(eq=False)  # one lifecycle per setup: compared by identity
class AutoCheckpointing:
    """The ``"auto"`` lifecycle: decide at setup with a batch there (:mod:`.planning_batch`), else at the first step
    from a meta twin; ``choice``: the outcome. ``blocks_per_unit``: ``None``: chosen at setup (1 when the batch comes
    later); ``required``: the user asked for ``"auto"`` (an unmeasurable step raises; the default warns, recipe's)."""

    budget: int
    measure: Measurement
    fixed_reshard: bool | None = None
    offload: bool = False  # offload="cpu" is on: plan with it; off: never assume it
    blocks_per_unit: int | None = None
    required: bool = True
    measures: bool = True  # this rank measures; else it takes rank 0's outcome
    twin: nn.Module | None = field(default=None, init=False)
    units_made: UnitRuns | None = field(default=None, init=False)  # the first step's plan: the units setup made
    choice: AutoChoice | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.units_left_to_planner = self.blocks_per_unit is None

    @property
    def pending(self) -> bool:
        return self.twin is not None and self.choice is None

    def at_setup(self, module: nn.Module, device: torch.device, agree: AgreePlan,
                 batch: PlanningBatch | None = None) -> AutoChoice | None:
        """The choice to apply now, or ``None`` when the batch is not known yet (a meta twin is kept)."""
        batch = batch or planning_batch(module, None)
        if batch is None:
            self.twin = meta_twin(module)
            self.blocks_per_unit = self.blocks_per_unit or 1  # the units are made now, before the batch is known
            return None
        return self._decide(module, batch, device, agree, "adamw")

    def at_first_step(self, batch: Any, device: torch.device, agree: AgreePlan, optimizers) -> AutoChoice:
        assert self.twin is not None
        try:
            return self._decide(self.twin, PlanningBatch(batch, FIRST_STEP, through_training_step=True), device,
                                agree, optimizer_kind(optimizers))
        finally:
            self.twin = None

    def choose(self, model: nn.Module, batch: Any, device: torch.device | None = None,
               optimizer: str = "adamw") -> AutoChoice:
        """Measure ``model`` (un-sharded, or its meta twin) fed ``batch`` (or a :class:`~.planning_batch.PlanningBatch`)
        and plan each block; :class:`MeasurementError` where the step cannot run on fake tensors. Blocks per unit
        pinned only because the units exist already: the hint says what a free choice would have saved."""
        batch = batch if isinstance(batch, PlanningBatch) else PlanningBatch(batch, EXAMPLE_INPUT)
        inputs, how = self._measured(model, batch, device, optimizer, unchecked=True)
        n, rates = len(inputs.profile.blocks), rates_for(device)
        sizes = None if self.units_left_to_planner else self.blocks_per_unit  # every unit layout plan_for may try
        space = SearchSpace(inputs, self.budget, rates, self.offload, self.fixed_reshard, sizes, (None,) * n)
        modes: Modes | None = space.modes
        if not fits_unchecked(space, self.blocks_per_unit):  # checkpointing may be needed: measure its modes too
            inputs, how = self._measured(model, batch, device, optimizer, unchecked=False)
            modes = None
        batch_size = batch_size_of(batch.value)

        def plan_for(units: int | None) -> MemoryPlan:  # the budget stands for the device's memory in the table
            return choose(inputs, self.budget, self.budget, self.measure.precision, batch_size, offload=self.offload,
                          rates=rates, reshard=self.fixed_reshard, per_unit=units, modes=modes)

        plan, hint = plan_for(self.blocks_per_unit), None
        if self.units_left_to_planner and self.blocks_per_unit is not None:
            free = plan_for(None)
            k, saved = free.blocks.per_unit, plan.extra_seconds - free.extra_seconds
            if k != plan.blocks.per_unit and saved > 0:
                hint = (f"activation_checkpointing='auto': {k} blocks per FSDP unit would save a predicted"
                        f" {saved * 1e3:.1f} ms per step, but units are made at setup, before the first batch. Set"
                        " `self.example_input_array` in the LightningModule so the planner chooses them at setup,"
                        f" or pass blocks_per_unit={k}.")
        names = [b.name for b in inputs.profile.blocks]
        return AutoChoice(plan, names, plan.blocks, unmet_budget(plan, inputs, self.offload), hint, how)

    def _measured(self, model: nn.Module, batch: PlanningBatch, device: torch.device | None, optimizer: str,
                  unchecked: bool) -> tuple[StepInputs, str]:
        """The step measured; ``unchecked``: with no block checkpointed only (every block's own passes under full
        and selective checkpointing: on a step run on real values, a detector's, real compute, half its setup)."""
        made = self.units_made  # units made at setup, before any step: their runs and order, not the measured step's
        measure = self.measure if made is None else dataclasses.replace(self.measure, order=made.names)
        try:
            inputs, how = measure(model, batch, device, (lambda *_: None) if unchecked else None, optimizer)
        except MeasurementError as error:  # what to do instead
            raise MeasurementError(
                f"activation_checkpointing='auto' could not measure {type(model).__name__} on fake tensors ({error})."
                " Pass activation_checkpointing=True (or an int / a predicate)."
            ) from error.__cause__
        if made is not None:
            names = tuple(block.name for block in inputs.profile.blocks)
            inputs = dataclasses.replace(inputs, runs=made if made.names == names else None)
        return inputs, how

    def _decide(self, model, example, device, agree: AgreePlan, optimizer) -> AutoChoice:
        # Every rank would measure the same shapes: rank 0 does, the others take its outcome (or measure: unpicklable)
        mine = self._outcome(model, example, device, optimizer) if self.measures else None
        shared = agree(mine if mine is None or _picklable(mine) else None)
        choice, calls = mine or shared or self._outcome(model, example, device, optimizer)
        vars(self.measure.calls).update(vars(calls))
        if isinstance(choice, BaseException):
            raise choice  # on every rank, so that none waits in a collective
        if choice.warning is not None:
            rank_zero_warn(choice.warning)
        if choice.hint is not None:
            rank_zero_info(choice.hint)
        self.choice = dataclasses.replace(choice, blocks=agree(choice.blocks))
        self.blocks_per_unit = self.choice.blocks.per_unit
        return self.choice

    def _outcome(self, model, example, device, optimizer) -> tuple[AutoChoice | Exception, Calls]:
        """The choice (the recipe's where the default's step cannot be measured), or the error to raise."""
        try:
            return self.choose(model, example, device, optimizer), self.measure.calls
        except MeasurementError as error:
            return (error if self.required else self._recipe(model, error.__cause__)), self.measure.calls
        except Exception as error:  # a refused tensor plan, a bug: raised by every rank
            return error, self.measure.calls

    def _recipe(self, model: nn.Module, cause: BaseException | None) -> AutoChoice:
        """The recipe's plan where the default's step could not be measured: every block full, resharded."""
        names = [name for name, _ in model_parts(model, self.measure.blocks, resolve_flag(self.measure.precision))[0]]
        n = len(names)
        plan = BlockPlan.prefix(n, n, 0, 0 if self.fixed_reshard is False else n, self.blocks_per_unit or 1)
        why = (f"VitScaleStrategy could not run {type(model).__name__}'s step on fake tensors ({briefly(cause)})"
               if cause is not None else f"VitScaleStrategy could not run {type(model).__name__}'s step")
        why += (", so it cannot plan for speed: every block checkpointed (if the activations fit, pass"
                " activation_checkpointing=False: no recompute, as DDP)")
        return AutoChoice(None, names, plan, why)

    def describe(self) -> str:
        if self.choice is None:
            return "auto: decided at the first training step, from its batch"
        return self.choice.describe()


def describe_prediction(
    inputs: StepInputs, checkpointed: list[str], reshard: bool, offload: bool = False, selective: Sequence[str] = (),
    blocks_per_unit: int = 1, kept_gathered: Sequence[str] = (), measured_on: str = EXAMPLE_INPUT,
    budget: int | None = None,
) -> tuple[int, str]:
    """The predicted peak for the settings the pipeline applied, as bytes and as the summary's line (naming the
    ``budget``, and saying so where the peak is over it)."""
    def at(names: Sequence[str]) -> frozenset[int]:
        return frozenset(i for i, block in enumerate(inputs.profile.blocks) if block.name in set(names))

    settings = StepSettings(at(checkpointed), reshard, offload, at(selective), at(kept_gathered), blocks_per_unit)
    peak = predict_step(inputs, settings)
    line = f"predicted peak {human_bytes(peak.peak)} per rank for {measured_on}, at {peak.phase}"
    if budget is not None:
        line += (f", over the memory_budget of {human_bytes(budget)}: checkpoint more blocks, a smaller batch or"
                 " activation_checkpointing='auto'" if peak.peak > budget else f", memory_budget {human_bytes(budget)}")
    return peak.peak, line
