"""What a ``training_step`` the planner runs on its meta twin gets from ``self.optimizers()``, ``self.lr_schedulers()``
and, under manual optimization, ``self.manual_backward`` and its kin: the step's forwards and losses, nothing stepped.

Setup measures the step before Lightning builds the optimizers, so a step reading them (``self.log("lr",
self.optimizers().param_groups[0]["lr"])``, ``self.lr_schedulers().get_last_lr()``, a common habit) raised on the
twin, and the planner, unable to plan for speed without ``forward``, checkpointed every block. A manual-optimization
step was not run at all: it steps optimizers, so it was measured through ``forward`` (a GAN's generator alone), or,
without ``forward``, not at all. Now the twin's ``configure_optimizers()`` builds them on its meta parameters (or the
trainer's are read, where they exist: the first step's plan), and the step reads them as they are; their ``step()``
only runs the closure it is given, ``zero_grad`` does nothing. Under manual optimization toggling and clipping do
nothing too, and ``manual_backward`` keeps the loss: the planner accounts for the backward. Each graph the step
builds is then alive at its end, where the real step frees one at each backward: the measured activations are their
sum, an upper bound of the step's peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.loggers.logger import DummyLogger

from lightning_vitscale._compat import configured_optimizers, train_dataloader
from lightning_vitscale._utils import trainer_of


class _Stepless:
    """An optimizer or scheduler read as it is (``param_groups``, ``get_last_lr()``), whose ``step`` runs only the
    closure it is given (a manual ``opt.step(closure)``'s forward and ``manual_backward``)."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped

    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        return closure() if callable(closure) else None

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        if name == "optimizer":  # LightningOptimizer.optimizer: the optimizer it wraps (a scheduler's: its own)
            return getattr(self.wrapped, "optimizer", self.wrapped)
        return getattr(self.wrapped, name)


class _QuietTrainer:
    """The run's trainer as the planner's step sees it: its loggers write nothing (a step logging an image or a
    histogram to TensorBoard at batch 0 wrote the planner's runs there too), its ``optimizers`` are the step's
    stepless ones (``self.trainer.optimizers[0].param_groups``) and so are its schedulers
    (``self.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()``), what the step sets stays here (a
    ``self.trainer.should_stop = True`` must not end the run before it starts), the train data is not set up
    (``estimated_stepping_batches``, below), the rest is the trainer's."""

    def __init__(self, trainer: Any, configured: Callable[[], tuple[list[Any], list[Any]]]) -> None:
        object.__setattr__(self, "trainer", trainer)
        object.__setattr__(self, "configured", configured)

    @property
    def optimizers(self) -> list[Any]:
        return self.configured()[0]

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        return self.configured()[1]

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Lightning's number where the train data is set up (a first step's plan); before, Lightning would set it up
        here, and the planner's run must not: one rank plans, and the data's setup has collectives
        (``has_len_all_ranks``) no other rank joined (2 ranks hung), and the iterator seed it draws would be drawn on
        that rank alone under the planner's fake tensors, then undone (one draw fewer than DDP's: other dropout
        masks from the first step). A schedule's length (OneCycleLR's ``total_steps``) changes no activation, so the
        planner's run gets Lightning's formula on the train loader as it is, and Lightning sets the data up for the
        run where DDP's setup does."""
        trainer = self.trainer
        if trainer.train_dataloader is not None:
            return trainer.estimated_stepping_batches
        return _steps_before_data_setup(trainer)

    @property
    def logger(self) -> Any:
        return DummyLogger() if self.trainer.logger is not None else None

    @property
    def loggers(self) -> list[Any]:
        return [DummyLogger() for _ in self.trainer.loggers]

    def __getattr__(self, name: str) -> Any:
        if name in ("trainer", "configured"):
            raise AttributeError(name)
        return getattr(self.trainer, name)


def _steps_before_data_setup(trainer: Any) -> int | float:
    """``Trainer.estimated_stepping_batches`` from the train loader before Lightning wraps it (its sampler split over
    the ranks by division), with no collective and no draw."""
    if trainer.max_epochs == -1:
        return float("inf") if trainer.max_steps == -1 else trainer.max_steps
    try:
        batches = math.ceil(len(train_dataloader(trainer)) / trainer.world_size)
    except TypeError:  # no length (an iterable): Lightning's number is max_steps too
        return trainer.max_steps
    limit = trainer.limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    steps = math.ceil(batches / trainer.accumulate_grad_batches) * max(trainer.max_epochs or 1, 1)
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps


def _as_lightning_returns(items: list[Any]) -> Any:
    """As ``LightningModule.optimizers()`` and ``lr_schedulers()`` return them: one alone, several as a list."""
    return items[0] if len(items) == 1 else items


def stand_ins(twin: Any, losses: list[torch.Tensor]) -> dict[str, Any]:
    """The twin's methods and trainer for one planned ``training_step``; ``losses`` gets each ``manual_backward``'s
    loss."""
    built: list[tuple[list[Any], list[Any]]] = []

    trainer = trainer_of(twin)

    def configured() -> tuple[list[Any], list[Any]]:
        if not built:  # built at the first read, on the twin's parameters: nothing of the real model is stepped
            built.append(_configured(twin, trainer))
        return built[0]

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        return _as_lightning_returns(configured()[0])

    def lr_schedulers() -> Any:
        schedulers = [config.scheduler for config in configured()[1]]
        return _as_lightning_returns(schedulers) if schedulers else None

    replaced: dict[str, Any] = {"optimizers": optimizers, "lr_schedulers": lr_schedulers}
    if trainer is not None:
        replaced["trainer"] = _QuietTrainer(trainer, configured)  # LightningModule's setter: its child modules too
    if getattr(twin, "automatic_optimization", True):
        return replaced

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        losses.append(loss)

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    return {**replaced, "manual_backward": manual_backward, "toggle_optimizer": nothing,
            "untoggle_optimizer": nothing, "clip_gradients": nothing,
            "toggled_optimizer": lambda *args, **kwargs: contextlib.nullcontext()}


def _configured(twin: Any, trainer: Any) -> tuple[list[Any], list[Any]]:
    """The trainer's optimizers and scheduler configs where it built them already (a first step's plan: stepping
    them would step the run), else the twin's own from ``configure_optimizers()``, parsed as Lightning parses them
    (its warnings are the real run's to give); either way their optimizers and schedulers stepless (``_Stepless``)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is not None and strategy.optimizers:
        optimizers, configs = list(strategy.optimizers), list(strategy.lr_scheduler_configs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizers, configs = configured_optimizers(twin.configure_optimizers(),
                                                        getattr(twin, "automatic_optimization", True))
    return ([_Stepless(o) for o in optimizers],
            [dataclasses.replace(config, scheduler=_Stepless(config.scheduler)) for config in configs])
