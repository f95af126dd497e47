"""``activation_checkpointing="auto"`` (and ``VitScaleStrategy()``'s default, ``priority="speed"``): per block
none / selective / full checkpointing, per unit reshard, and the blocks per unit: the fastest plan that keeps a step
in budget.

Checkpointing every block costs about a third more compute even where the activations would fit. Here the
memory planner predicts the step's peak per rank from the real batch shape (measured on fake tensors, so no
memory is spent finding out) and the step time of each choice (:mod:`.step_cost`), and picks the plan with the
least time whose peak fits the budget (:mod:`.plan_search`).
The batch is known either at setup (``example_input_array``) or at the first training step; in the second case
a meta-device twin of the module (same structure, no data) is kept from setup, because the sharded module's
FSDP hooks would all-gather if it were run for measuring, and the units (made at setup) are one block each.
Choosing lives here; the sharding setup applies the choice (``sharding/setup.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_vitscale._compat import cuda_memory_fraction
from lightning_vitscale._utils import available_host_bytes, human_bytes
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.discovery.tensor_plan import TensorPlanError
from lightning_vitscale.memory.activations import ModeOf
from lightning_vitscale.memory.gradient_release import may_release_after_step
from lightning_vitscale.memory.memory_plan import MemoryPlan
from lightning_vitscale.memory.plan_search import BlockMode, BlockPlan
from lightning_vitscale.memory.planner import batch_size_of, choose, model_parts
from lightning_vitscale.memory.planning_batch import (
    EXAMPLE_INPUT,
    FIRST_STEP,
    PlanningBatch,
    measure_batch,
    meta_twin,
    planning_batch,
)
from lightning_vitscale.memory.step_cost import rates_for
from lightning_vitscale.memory.step_model import StepInputs, StepSettings, TrainingLoop, predict_step
from lightning_vitscale.precision import resolve_flag

AgreePlan = Callable[[BlockPlan], BlockPlan]
"""Every rank gets the same plan (``RankContext.broadcast``: rank 0's, searched for the budget every rank agreed)."""


class MeasurementError(RuntimeError):
    """The step could not run on fake tensors, so the planner has nothing to choose from."""


@dataclass(frozen=True)
class AutoChoice:
    """Each block's checkpointing mode and reshard, and the plan that chose them.

    ``blocks`` is what is applied: the plan every rank agreed on. ``plan`` is ``None`` where the step could not be
    measured and the default fell back to the recipe's plan (``warning`` says why).
    """

    plan: MemoryPlan | None
    block_names: list[str]
    blocks: BlockPlan
    warning: str | None = None
    hint: str | None = None
    measured: str = EXAMPLE_INPUT
    """Where the batch came from and how it was run (:func:`~.planning_batch.measure_batch`)."""

    @property
    def modes(self) -> dict[str, BlockMode]:
        """Checkpointed block name -> ``"full"`` or ``"selective"``, in model order."""
        return {name: mode for name, mode in zip(self.block_names, self.blocks.modes) if mode is not None}

    @property
    def names(self) -> list[str]:
        return list(self.modes)

    @property
    def kept_gathered(self) -> list[str]:
        """Blocks that keep their gathered parameters from forward to backward: those whose whole unit does."""
        settings = self.blocks.settings()
        return [name for i, name in enumerate(self.block_names) if settings.keeps(i)]

    def describe(self) -> str:
        p = self.plan
        if p is None:
            return f"auto: {self.blocks.describe()} ({self.warning})"
        every, none = p.all_checkpointed.breakdown.peak, p.none_checkpointed.breakdown.peak
        return (f"auto: {self.blocks.describe()} (measured on {self.measured}),"
                f" predicted peak {human_bytes(p.chosen.breakdown.peak)} per rank"
                f" (budget {human_bytes(p.budget)}; every block full {human_bytes(every)}, none {human_bytes(none)});"
                f" predicted step time it adds {p.extra_seconds * 1e3:.1f} ms (recompute, all-gathers, per unit)")


def device_memory(device: torch.device, local_ranks: int = 1) -> int:
    """What one rank may count on: the GPU's memory (its share under ``torch.cuda.set_per_process_memory_fraction``),
    or the host's available memory shared by the local ranks."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * cuda_memory_fraction(device))
    return (available_host_bytes() or 0) // max(1, local_ranks)


def training_loop(module: nn.Module, trainer: pl.Trainer | None) -> TrainingLoop:
    """When Lightning's loop keeps ``module``'s gradients alive: its optimization mode, the Trainer's
    ``accumulate_grad_batches`` and whether the strategy frees them after the step (:mod:`.gradient_release`).
    Without a Trainer (a plain planning call): automatic, no accumulation, nothing released."""
    automatic = bool(getattr(module, "automatic_optimization", True))
    if trainer is None:
        return TrainingLoop(automatic=automatic)
    return TrainingLoop(automatic=automatic, accumulate=trainer.accumulate_grad_batches,
                        released_after_step=may_release_after_step(module, trainer))


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


def choose_blocks(
    model: nn.Module,
    example_input: Any,
    *,
    world_size: int,
    precision: str,
    budget: int,
    optimizer: str = "adamw",
    blocks: Any = None,
    device: torch.device | None = None,
    offload: bool = False,
    fixed_reshard: bool | None = None,
    per_unit: int | None = 1,
    compare_units: bool = False,
    replicas: int = 1,
    tensor_parallel: int = 1,
    tensor_plan: Any = None,
    calls: Calls | None = None,
    trainer: pl.Trainer | None = None,
) -> AutoChoice:
    """Run ``model`` (the un-sharded module or its meta twin) on fake tensors and pick each block's checkpointing
    and reshard, for the offload setting that is on and the loop order of the Trainer ``model`` is attached to.
    ``example_input``: fed to ``forward``, or a :class:`~.planning_batch.PlanningBatch` (a training batch runs
    through ``training_step``). ``budget``: bytes (resolved once per setup). ``fixed_reshard``: every unit's reshard
    as the user pinned it (``None``: chosen per unit). ``per_unit``: the blocks per FSDP unit, or ``None`` to choose
    them too (only before the model is sharded). ``compare_units``: the blocks per unit are pinned only because the
    model is sharded already; say in :attr:`AutoChoice.hint` what a free choice would have saved. ``world_size``:
    the ranks of one shard group; ``replicas``: hybrid sharding's copies of it (their all-reduce is costed,
    :mod:`.collectives`); ``tensor_parallel`` / ``tensor_plan``: the strategy's, each block planned as one
    tensor-parallel rank's share (:mod:`.tensor_split`). Raises :class:`MeasurementError` where the step cannot run
    on fake tensors. ``calls``: what the step called (:func:`~.planner.step_inputs`); ``trainer``: the one whose
    loop the step runs in (:func:`training_loop`)."""
    batch = example_input if isinstance(example_input, PlanningBatch) else PlanningBatch(example_input, EXAMPLE_INPUT)
    try:
        inputs, how = measure_batch(model, batch, world_size=world_size, precision=precision, optimizer=optimizer,
                                    blocks=blocks, device=device, loop=training_loop(model, trainer),
                                    tensor_parallel=tensor_parallel, tensor_plan=tensor_plan, calls=calls)
        inputs = dataclasses.replace(inputs, replicas=replicas)
    except TensorPlanError:  # the plan is refused: that, not the measurement, is what to fix
        raise
    except Exception as error:  # a forward that cannot run on fake tensors must say what to do instead
        raise MeasurementError(
            f"activation_checkpointing='auto' could not measure {type(model).__name__} on fake tensors"
            f" ({type(error).__name__}: {error}). Pass activation_checkpointing=True (or an int / a predicate)."
        ) from error
    batch_size = batch_size_of(batch.value)

    def plan_for(units: int | None) -> MemoryPlan:  # the budget stands for the device's memory in the plan's table
        return choose(inputs, budget, budget, precision, batch_size, offload=offload, rates=rates_for(device),
                      reshard=fixed_reshard, per_unit=units)

    plan = plan_for(per_unit)
    hint = grouping_hint(plan, plan_for(None)) if compare_units else None
    names = [b.name for b in inputs.profile.blocks]
    return AutoChoice(plan, names, plan.blocks, unmet_budget(plan, inputs, offload), hint, how)


def grouping_hint(applied: MemoryPlan, free: MemoryPlan) -> str | None:
    """What choosing ``blocks_per_unit`` at setup would have saved, when the batch was known only at the first step."""
    k, saved = free.blocks.per_unit, applied.extra_seconds - free.extra_seconds
    if k == applied.blocks.per_unit or saved <= 0:
        return None
    return (f"activation_checkpointing='auto': {k} blocks per FSDP unit would save a predicted {saved * 1e3:.1f} ms"
            f" per step, but units are made at setup, before the first batch. Set `self.example_input_array` in"
            f" the LightningModule so the planner chooses them at setup, or pass blocks_per_unit={k}.")


def optimizer_kind(optimizers: list[torch.optim.Optimizer]) -> str:
    """The planner's name for the state the user's optimizer keeps (AdamW when unknown: the larger)."""
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, torch.optim.SGD):
            momentum = any(group.get("momentum", 0) for group in inner.param_groups)
            return "sgd-momentum" if momentum else "sgd"
    return "adamw"


class AutoCheckpointing:
    """The ``"auto"`` lifecycle: decide at setup when a batch is known there (``example_input_array``, or one
    batch of the train dataloader: :mod:`.planning_batch`), else keep a meta twin and decide at the first training
    step. ``choice`` holds the outcome for the caller to apply.

    ``budget``: bytes, the same on every rank; ``fixed_reshard``: every unit's reshard as pinned (``None``: chosen
    per unit); ``blocks_per_unit``: pinned, or ``None``: chosen with the rest at setup (1 when the batch comes only
    later); ``required``: the user asked for ``"auto"`` (a step that cannot be measured raises), else it is the
    default's plan, which then falls back to the recipe's (every block full, resharded) with a warning.
    """

    def __init__(
        self,
        budget: int,
        world_size: int,
        precision: str,
        blocks: Any,
        fixed_reshard: bool | None = None,
        offload: bool = False,
        blocks_per_unit: int | None = None,
        replicas: int = 1,
        tensor_parallel: int = 1,
        tensor_plan: Any = None,
        required: bool = True,
        trainer: pl.Trainer | None = None,
    ) -> None:
        self.budget, self.world_size, self.precision, self.blocks = budget, world_size, precision, blocks
        self.replicas = replicas  # hybrid sharding: world_size is one shard group, replicated this many times
        self.tensor_parallel, self.tensor_plan = tensor_parallel, tensor_plan  # each block split this many ways
        self.per_unit = blocks_per_unit
        self.units_left_to_planner = blocks_per_unit is None
        self.offload = offload  # offload="cpu" is on: plan with it; off: never assume it
        self.fixed_reshard, self.required, self.trainer = fixed_reshard, required, trainer
        self.twin: nn.Module | None = None
        self.choice: AutoChoice | None = None
        self.calls = Calls()  # what the measured step called: the units are what it runs

    @property
    def pending(self) -> bool:
        return self.twin is not None and self.choice is None

    def at_setup(self, module: nn.Module, device: torch.device, agree: AgreePlan,
                 batch: PlanningBatch | None = None) -> AutoChoice | None:
        """The choice to apply now, or ``None`` when the batch is not known yet (a meta twin is kept). ``batch``:
        what setup found (default: ``example_input_array``)."""
        batch = batch or planning_batch(module, None)
        if batch is None:
            self.twin = meta_twin(module)
            self.per_unit = self.per_unit or 1  # the units are made now, before the batch is known
            return None
        return self._decide(module, batch, device, agree, "adamw")

    def at_first_step(self, batch: Any, device: torch.device, agree: AgreePlan, optimizers) -> AutoChoice:
        assert self.twin is not None
        try:
            return self._decide(self.twin, PlanningBatch(batch, FIRST_STEP, through_training_step=True), device,
                                agree, optimizer_kind(optimizers))
        finally:
            self.twin = None

    def _decide(self, model, example, device, agree: AgreePlan, optimizer) -> AutoChoice:
        try:
            choice = choose_blocks(
                model, example, world_size=self.world_size, precision=self.precision, budget=self.budget,
                optimizer=optimizer, blocks=self.blocks, device=device, offload=self.offload,
                fixed_reshard=self.fixed_reshard, per_unit=self.per_unit,
                compare_units=self.units_left_to_planner and self.per_unit is not None, replicas=self.replicas,
                tensor_parallel=self.tensor_parallel, tensor_plan=self.tensor_plan, calls=self.calls,
                trainer=self.trainer)
        except MeasurementError as error:
            if self.required:
                raise
            choice = self._recipe(model, error.__cause__)
        if choice.warning is not None:
            rank_zero_warn(choice.warning)
        if choice.hint is not None:
            rank_zero_info(choice.hint)
        self.choice = dataclasses.replace(choice, blocks=agree(choice.blocks))
        self.per_unit = self.choice.blocks.per_unit
        return self.choice

    def _recipe(self, model: nn.Module, cause: BaseException | None) -> AutoChoice:
        """The recipe's plan where the default's step could not be measured: every block full, resharded."""
        names = [name for name, _ in model_parts(model, self.blocks, resolve_flag(self.precision))[0]]
        n = len(names)
        plan = BlockPlan.prefix(n, n, 0, 0 if self.fixed_reshard is False else n, self.per_unit or 1)
        why = (f"VitScaleStrategy could not run {type(model).__name__}'s step on fake tensors"
               f" ({type(cause).__name__}: {cause}), so it cannot plan for speed: every block checkpointed")
        return AutoChoice(None, names, plan, why)

    def describe(self) -> str:
        """The setup summary's line: the choice, or that it waits for the first training step's batch."""
        if self.choice is None:
            return "auto: decided at the first training step, from its batch"
        return self.choice.describe()


def measure_for_summary(
    module: nn.Module,
    batch: PlanningBatch | None,
    world_size: int,
    precision: str,
    blocks: Any,
    device: torch.device | None = None,
    mode_of: ModeOf | None = None,
    replicas: int = 1,
    tensor_parallel: int = 1,
    tensor_plan: Any = None,
    calls: Calls | None = None,
    trainer: pl.Trainer | None = None,
) -> tuple[StepInputs | None, str] | None:
    """Fake-tensor measurement of ``batch`` (see :func:`~.planning_batch.measure_batch`) for the setup summary's
    predicted peak and the planner's grouping, and how it was measured; ``mode_of``: each block's checkpointing,
    settled by the user (each block is measured for it alone); ``world_size``: one shard group, ``replicas``:
    hybrid sharding's copies of it; ``tensor_parallel`` / ``tensor_plan``: one tensor-parallel rank's share;
    ``calls``: what the step called (:func:`~.planner.step_inputs`). ``None`` without a batch.

    A step that cannot run on fake tensors gives ``(None, why)``: nothing needs the prediction, the summary says why
    it is missing. A refused tensor-parallel plan raises.
    """
    if batch is None:
        return None
    try:
        inputs, how = measure_batch(module, batch, world_size=world_size, precision=precision, blocks=blocks,
                                    device=device, loop=training_loop(module, trainer), mode_of=mode_of,
                                    tensor_parallel=tensor_parallel, tensor_plan=tensor_plan, calls=calls)
        return dataclasses.replace(inputs, replicas=replicas), how
    except TensorPlanError:
        raise
    except Exception as error:  # noqa: BLE001 - said in the summary (see docstring)
        where = f" in {calls.where}" if calls is not None and calls.where else ""
        return None, f"{batch.source} could not run on fake tensors{where} ({type(error).__name__}: {error})"


def describe_prediction(
    inputs: StepInputs,
    checkpointed: list[str],
    reshard: bool,
    offload: bool = False,
    selective: Sequence[str] = (),
    blocks_per_unit: int = 1,
    kept_gathered: Sequence[str] = (),
    measured_on: str = EXAMPLE_INPUT,
    budget: int | None = None,
) -> tuple[int, str]:
    """The predicted peak for the settings the pipeline applied (``selective``: the blocks of ``checkpointed``
    checkpointed op-level; ``kept_gathered``: blocks whose unit stays gathered for backward), as bytes and as a
    summary line (``measured_on``: the batch's source, see :func:`~.planning_batch.measure_batch`; ``budget``:
    the resolved ``memory_budget``, named, and said to be exceeded where the peak is over it)."""
    names = [b.name for b in inputs.profile.blocks]
    indices = frozenset(i for i, name in enumerate(names) if name in set(checkpointed))
    chosen = frozenset(i for i in indices if names[i] in set(selective))
    kept = frozenset(i for i, name in enumerate(names) if name in set(kept_gathered))
    peak = predict_step(inputs, StepSettings(indices, reshard, offload, chosen, kept, blocks_per_unit))
    line = f"predicted peak {human_bytes(peak.peak)} per rank for {measured_on}, at {peak.phase}"
    if budget is not None:
        line += (f", over the memory_budget of {human_bytes(budget)}: checkpoint more blocks, a smaller batch or"
                 " activation_checkpointing='auto'" if peak.peak > budget else f", memory_budget {human_bytes(budget)}")
    return peak.peak, line
