"""Mechanism for ``activation_checkpointing="auto"``: checkpoint the fewest blocks that keep a step in budget.

Checkpointing every block costs about a third more compute even where the activations would fit. Here the
memory planner predicts the step's peak per rank from the real batch shape (measured on fake tensors, so no
memory is spent finding out) and checkpoints the earliest blocks until the prediction fits the budget.
The batch is known either at setup (``example_input_array``) or at the first training step; in the second case
a meta-device twin of the module (same structure, no data) is kept from setup, because the sharded module's
FSDP hooks would all-gather if it were run for measuring.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import FSDPModule
from lightning_vitscale.activation_checkpointing import apply_activation_checkpointing
from lightning_vitscale.memory_budget import StepInputs
from lightning_vitscale.plan import ParallelPlan
from lightning_vitscale.plan_report import gib
from lightning_vitscale.planner import MemoryPlan, choose, step_inputs
from lightning_vitscale.policies import CheckpointingPolicy, ParallelConfig

DEFAULT_FRACTION = 0.9


@dataclass(frozen=True)
class AutoChoice:
    """Which blocks to checkpoint, and the plan that chose them."""

    names: list[str]
    plan: MemoryPlan
    block_names: list[str]
    keep_gathered: bool = False

    def describe(self) -> str:
        p = self.plan
        peak = p.chosen.breakdown.peak
        gathered = ", blocks stay gathered for backward" if self.keep_gathered else ""
        return (f"auto: {len(self.names)} of {p.num_blocks} blocks{gathered}, predicted peak {gib(peak)} per rank"
                f" (budget {gib(p.budget)}; every block {gib(p.all_checkpointed.breakdown.peak)},"
                f" none {gib(p.none_checkpointed.breakdown.peak)})")


def device_memory(device: torch.device, local_ranks: int = 1) -> int:
    """What one rank may count on: the GPU's memory, or the host's available memory shared by the local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    available = _meminfo_bytes("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available // max(1, local_ranks)


def _meminfo_bytes(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resolve_budget(budget: int | float | None, total: int) -> int:
    """``memory_budget`` -> bytes: an int is bytes, a float (or ``None`` = 0.9) a fraction of ``total``."""
    if isinstance(budget, int) and not isinstance(budget, bool):
        return budget
    return int(total * (DEFAULT_FRACTION if budget is None else budget))


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors: structure without data.

    Tensors are mapped to meta stand-ins in ``deepcopy``'s memo, so no parameter is ever copied; anything the
    module refers to that is not its own (trainer, device mesh) is shared, not copied.
    """
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    for name in ("_trainer", "_device_mesh", "_fabric", "_metric_attributes"):
        value = module.__dict__.get(name)
        if value is not None:
            memo[id(value)] = value
    return copy.deepcopy(module, memo)


def first_tensor_input(batch: Any) -> Any:
    """The model input in a batch as Lightning passes it: a tensor, or the first element of a tuple/list/dict."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch:
        return first_tensor_input(batch[0])
    if isinstance(batch, dict) and batch:
        return first_tensor_input(next(iter(batch.values())))
    raise ValueError(
        f"activation_checkpointing='auto' could not find the model input in a batch of type {type(batch).__name__}."
        " Set `self.example_input_array` in the LightningModule, or pass activation_checkpointing=True."
    )


def choose_blocks(
    model: nn.Module,
    example_input: Any,
    *,
    world_size: int,
    precision: str,
    budget: int,
    total: int,
    optimizer: str = "adamw",
    blocks: Any = None,
    device: torch.device | None = None,
) -> AutoChoice:
    """Run ``model`` (the un-sharded module or its meta twin) on fake tensors and pick the blocks to checkpoint."""
    try:
        inputs: StepInputs = step_inputs(model, example_input, world_size=world_size, precision=precision,
                                         optimizer=optimizer, blocks=blocks, device=device)
    except Exception as error:  # a forward that cannot run on fake tensors must say what to do instead
        raise RuntimeError(
            f"activation_checkpointing='auto' could not measure {type(model).__name__} on fake tensors"
            f" ({type(error).__name__}: {error}). Pass activation_checkpointing=True (or an int / a predicate)."
        ) from error
    batch = int(getattr(example_input, "shape", [1])[0]) if isinstance(example_input, torch.Tensor) else 1
    plan = choose(inputs, budget, total, precision, batch)
    names = [b.name for i, b in enumerate(inputs.profile.blocks) if i in plan.chosen.settings.checkpointed]
    keep = not plan.chosen.settings.reshard_after_forward
    return AutoChoice(names, plan, [b.name for b in inputs.profile.blocks], keep)


def optimizer_kind(optimizers: list[torch.optim.Optimizer]) -> str:
    """The planner's name for the state the user's optimizer keeps (AdamW when unknown: the larger)."""
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, torch.optim.SGD):
            momentum = any(group.get("momentum", 0) for group in inner.param_groups)
            return "sgd-momentum" if momentum else "sgd"
    return "adamw"


class AutoCheckpointing:
    """The ``"auto"`` lifecycle: decide at setup when the module has ``example_input_array``, else keep a meta
    twin and decide at the first training step; then checkpoint the chosen blocks in place (also once sharded:
    the patched forward runs inside the block's FSDP hooks, as when it is applied before ``fully_shard``)."""

    def __init__(
        self, budget: int | float | None, world_size: int, precision: str, blocks: Any, may_keep_gathered: bool
    ) -> None:
        self.budget, self.world_size, self.precision, self.blocks = budget, world_size, precision, blocks
        self.may_keep_gathered = may_keep_gathered  # the user left reshard_after_forward to the recipe
        self.twin: nn.Module | None = None
        self.choice: AutoChoice | None = None

    @property
    def pending(self) -> bool:
        return self.twin is not None and self.choice is None

    def at_setup(self, module: nn.Module, device: torch.device, local_ranks: int, agree) -> list[str] | None:
        """Names to checkpoint now, or ``None`` when the batch is not known yet (a meta twin is kept)."""
        example = getattr(module, "example_input_array", None)
        if example is None:
            self.twin = meta_twin(module)
            return None
        return self._decide(module, example, device, local_ranks, agree, "adamw")

    def at_first_step(self, batch: Any, device: torch.device, local_ranks: int, agree, optimizers) -> list[str]:
        assert self.twin is not None
        try:
            return self._decide(self.twin, first_tensor_input(batch), device, local_ranks, agree,
                                optimizer_kind(optimizers))
        finally:
            self.twin = None

    def _decide(self, model, example, device, local_ranks, agree, optimizer) -> list[str]:
        total = device_memory(device, local_ranks)
        choice = choose_blocks(model, example, world_size=self.world_size, precision=self.precision,
                               budget=resolve_budget(self.budget, total), total=total, optimizer=optimizer,
                               blocks=self.blocks, device=device)
        # Every rank checkpoints the same blocks: the most any rank needs (free host memory differs by rank).
        names = choice.block_names[: agree(len(choice.names))]  # the chosen blocks are the earliest ones
        # Keeping blocks gathered changes the collectives: only if every rank can (the fewest of any rank).
        keep = bool(-agree(-int(choice.keep_gathered and self.may_keep_gathered and not names)))
        self.choice = AutoChoice(names, choice.plan, choice.block_names, keep)
        return names

    def note(self, plan: ParallelPlan) -> None:
        """The choice (or that it waits for the first step) in the plan, and so in the setup summary."""
        if self.choice is not None:
            plan.checkpointed = list(self.choice.names)
            plan.predicted_peak = self.choice.plan.chosen.breakdown.peak
            plan.memory = self.choice.describe()
        else:
            plan.memory = "auto: decided at the first training step, from its batch"

    def config_at_setup(
        self, module: nn.Module, config: ParallelConfig, device: torch.device, local_ranks: int, agree
    ) -> ParallelConfig:
        """``config`` with the blocks chosen now as its checkpointing selector, or unchanged if the choice waits
        for the first step's batch."""
        names = self.at_setup(module, device, local_ranks, agree)
        if names is None:
            return config
        chosen = set(names)
        return dataclasses.replace(config, checkpointing=CheckpointingPolicy(blocks=lambda name, _: name in chosen))

    def apply_at_first_step(self, module: nn.Module, batch: Any, device: torch.device, local_ranks: int, agree,
                            optimizers) -> None:
        """Decide from the first batch and checkpoint the chosen blocks in place (they are FSDP units already)."""
        names = self.at_first_step(batch, device, local_ranks, agree, optimizers)
        apply_activation_checkpointing([module.get_submodule(name) for name in names])
        self.keep_gathered(module)

    def keep_gathered(self, module: nn.Module) -> None:
        """Blocks keep their gathered parameters from forward to backward: one all-gather per block fewer."""
        if self.choice is not None and self.choice.keep_gathered:
            for name in self.choice.block_names:
                block = module.get_submodule(name)
                assert isinstance(block, FSDPModule), f"{name} is not an FSDP unit"
                block.set_reshard_after_forward(False, recurse=False)


def measure_for_summary(
    module: nn.Module, world_size: int, precision: str, blocks: Any, device: torch.device | None = None
) -> StepInputs | None:
    """Fake-tensor measurement for the setup summary's predicted peak, when ``example_input_array`` is set.

    Only informative: a module whose forward cannot run on fake tensors gets no prediction, not an error.
    """
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None
    try:
        return step_inputs(module, example, world_size=world_size, precision=precision, blocks=blocks,
                           device=device)
    except Exception:  # noqa: BLE001 - see docstring
        return None


def describe_prediction(inputs: StepInputs, checkpointed: list[str], reshard: bool) -> tuple[int, str]:
    """The predicted peak for the settings the pipeline applied, as bytes and as a summary line."""
    from lightning_vitscale.memory_budget import StepSettings, predict_step

    chosen = {b.name for b in inputs.profile.blocks} & set(checkpointed)
    indices = frozenset(i for i, b in enumerate(inputs.profile.blocks) if b.name in chosen)
    peak = predict_step(inputs, StepSettings(indices, reshard))
    return peak.peak, f"predicted peak {gib(peak.peak)} per rank for example_input_array, at {peak.phase}"
