"""A LightningModule sharded by the recipe (:class:`ShardedModel`, made by ``setup.shard_lightning_module``): what
its steps still need: the first step's decisions (checkpointing, compilation), the optimizers' flat step, the
step's errors named, the backward's hand-overs (fp32 norms, skipped blocks, frozen gradients), accumulation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import hook_root_pre_backward
from lightning_vitscale._utils import human_bytes
from lightning_vitscale.distributed import RankContext
from lightning_vitscale.distributed.whereabouts import note_backward, note_batch
from lightning_vitscale.kernels import AttentionRouter, auto_attention_step
from lightning_vitscale.memory import (
    AccumulationChoice,
    AccumulationMode,
    AutoCheckpointing,
    choose_accumulation,
    release_gradients,
)
from lightning_vitscale.precision import ReplicatedNorms, flat_step, lightning_grad_norm_named, refuse_unshardable
from lightning_vitscale.sharding.activation_checkpointing import CHECKPOINT_MODES, apply_activation_checkpointing
from lightning_vitscale.sharding.deferred_compile import DeferredCompile
from lightning_vitscale.sharding.gradient_sync import gradient_sync_off, unsharded_gradient_bytes
from lightning_vitscale.sharding.gradients_of_gradients import GradientsOfGradients
from lightning_vitscale.sharding.mixed_tensors import mixed_tensors_named
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.outer_unit_errors import SecondBackwardError
from lightning_vitscale.sharding.planning import apply_auto_choice
from lightning_vitscale.sharding.skipped_blocks import SkippedBlockCheck, UnusedParameters
from lightning_vitscale.sharding.stand_ins import StandIns
from lightning_vitscale.sharding.summary import SetupSummary
from lightning_vitscale.sharding.unit_members import reshard_units
from lightning_vitscale.sharding.whole_terms import whole_where_mixed


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
    stand_ins: StandIns | None = None  # several ranks, find_unused_parameters="units": skipped blocks stood in for
    deferred_compile: DeferredCompile | None = None  # kernels="auto" without a batch at setup
    # The module's parameters as setup left them (the DTensors optimizers step; in a step the modules may hold
    # gathered copies instead), and before a backward the frozen ones' gradients (FSDP2's path).
    parameters: list[nn.Parameter] = dataclasses.field(default_factory=list)
    _frozen_gradients: list[tuple[nn.Parameter, torch.Tensor | None]] = dataclasses.field(default_factory=list)
    gradients_of_gradients: GradientsOfGradients | None = None  # FSDP2's path (``gradients_of_gradients.py``)

    def __post_init__(self) -> None:
        if self.fsdp2_runs_steps:
            norm_leaf = self.norms.leaf_of if self.norms is not None else None
            self.gradients_of_gradients = GradientsOfGradients(self.outer, self.outer.deferred_reduction, norm_leaf)

    @property
    def module(self) -> nn.Module:
        return self.outer.module

    @property
    def fsdp2_runs_steps(self) -> bool:
        """FSDP2's path (several ranks, or units of their own), not one rank's compute copies."""
        return self.outer.compute_copies is None and isinstance(self.outer, FSDPModule)

    def before_training_step(self, batch: Any, ranks: RankContext, optimizers: list[torch.optim.Optimizer]) -> None:
        """``activation_checkpointing="auto"`` without a batch at setup: decide from the first batch, then checkpoint
        the chosen blocks in place (inside their FSDP hooks, as when applied before ``fully_shard``)."""
        note_batch()  # where this rank is: a rank alone in a handshake learns it went on (distributed/whereabouts.py)
        deferred = self.deferred_compile
        if batch is not None and deferred is not None:
            deferred.if_the_batch_grew(batch, self.module, self.summary, self.auto, ranks.device)
        if batch is None or self.auto is None or not self.auto.pending:
            return
        modes = self.auto.at_first_step(batch, ranks.device, ranks.broadcast, optimizers).modes
        for mode in CHECKPOINT_MODES:
            apply_activation_checkpointing([self.module.get_submodule(n) for n, m in modes.items() if m == mode], mode)
        apply_auto_choice(self.module, self.auto, self.summary)
        rank_zero_info(f"VitScaleStrategy activation checkpointing {self.summary.memory}")
        if deferred is not None:  # after checkpointing, as at setup: the recompute is traced too
            deferred.at_first_step(self.module, self.summary, self.auto, ranks.device)

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
        """Run ``step`` (an out-of-memory error and a second backward's freed storage named; a term on sharded
        parameters meeting plain tensors taken whole: ``whole_terms.py``); under ``attention="auto"`` the first steps
        time the kernels."""
        self.backwards_in_step = 0
        if self.skipped is not None:
            self.skipped.reset()
        twice = self.gradients_of_gradients
        whole = whole_where_mixed() if self.outer.compute_copies is None else nullcontext()  # copies: no DTensor
        with self.step_errors_named(), self.second_backward_named(), twice.in_step() if twice else nullcontext(), \
                whole:
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

    def before_backward(self, loss: torch.Tensor) -> None:
        """A rank that skipped a block raises before it sends a gradient (``skipped_blocks.py``); a backward inside
        the step (manual optimization) frees the gathered outer unit: the step's writes to it are carried first, and,
        on FSDP2's path, ``loss`` gets the root's pre-backward hook, which FSDP2 puts on the step's output (the loss of
        automatic optimization) and no tensor of a manual step carries: without it a backward reaching no block unit
        (a model of one unit; a critic's loss on a generator run under ``no_grad``) never reduced the outer unit's
        gradients, and the optimizer stepped without them."""
        note_backward()  # a rank alone in a handshake learns this rank went on (distributed/whereabouts.py)
        if self.gradients_of_gradients is not None:  # Lightning's backward follows the step (automatic optimization)
            self.gradients_of_gradients.before_backward(loss)
        if self.outer._in_step:
            self.outer.carry_writes()
            if self.fsdp2_runs_steps:
                hook_root_pre_backward(cast(FSDPModule, self.outer), loss)
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
        """Torch's "out of bounds for storage of size 0" from a second backward in a training step on FSDP2's path
        run outside ``manual_backward`` (which hooks the root's pre-backward, gathering what the first backward
        freed), raised as :class:`SecondBackwardError`."""
        try:
            yield
        except RuntimeError as error:
            fsdp_path = self.outer.compute_copies is None
            if not (fsdp_path and self.backwards_in_step and "storage of size 0" in str(error)):
                raise
            raise SecondBackwardError(
                f"{error}\nA second backward through a graph kept with `retain_graph=True` in the same"
                " `training_step` ran outside `self.manual_backward(...)` (e.g. `loss.backward()`): FSDP2 freed the"
                " gathered parameters that graph saved at the end of the first backward (several ranks, or one rank"
                " with several units; DDP has no such state), and only a backward through `manual_backward` gathers"
                " them again. Call `self.manual_backward(loss)` for every backward, as Lightning's manual optimization"
                " asks."
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
