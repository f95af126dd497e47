"""The strategy's launcher, which turns ``ckpt_path="last"`` and ``auto_resume`` into the newest complete checkpoint.

Lightning resolves ``ckpt_path`` before any strategy hook runs; only the launcher sees the call first. This is
Lightning's own launcher, first replacing the run's ``ckpt_path`` by what ``checkpoint/resume.py`` finds. Nothing
of Lightning is changed: other trainers, and this one under another strategy, keep its rules.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_vitscale._compat import SubprocessScriptLauncher, with_ckpt_path
from lightning_vitscale.checkpoint.resume import auto_resume_path, last_path
from lightning_vitscale.checkpoint.strategy_side import StrategyCheckpoints


class ResumeLauncher(SubprocessScriptLauncher):
    """Lightning's launcher of the strategy's ranks, resolving ``ckpt_path`` first (:func:`resolve_ckpt_path`)."""

    def __init__(self, environment: Any, num_processes: int, num_nodes: int, checkpoints: StrategyCheckpoints) -> None:
        assert environment is not None  # set by Lightning's accelerator connector before it configures launchers
        super().__init__(environment, num_processes, num_nodes)
        self.checkpoints = checkpoints

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.cluster_environment.creates_processes_externally  # it starts nothing: as with no launcher

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            resolve = partial(resolve_ckpt_path, trainer, side=self.checkpoints)
            args, kwargs = with_ckpt_path(function, args, kwargs, resolve)
        if self.cluster_environment.creates_processes_externally:
            return function(*args, **kwargs)  # what Lightning does with no launcher (torchrun, SLURM, started ranks)
        return super().launch(function, *args, trainer=trainer, **kwargs)


def resolve_ckpt_path(trainer: Any, ckpt_path: Any, side: StrategyCheckpoints) -> Any:
    """What the run loads instead of ``ckpt_path`` (``resume.py``: ``auto_resume`` when fitting, ``"last"``); the
    older complete ones become the load's fallbacks. Anything else, or nothing found: ``ckpt_path`` itself."""
    if trainer.state.fn == TrainerFn.FITTING and side.settings.auto_resume:
        found, fallbacks = auto_resume_path(trainer)
        if found is not None:
            side.resume_fallbacks = fallbacks
            ignored = f" (ckpt_path={ckpt_path!r} is ignored: there is a run to resume)" if ckpt_path else ""
            rank_zero_info(f"auto_resume: resuming from {found}{ignored}")
            return found.url if found.is_url else found.path
        rank_zero_warn(f"auto_resume: no complete checkpoint found; starting from ckpt_path={ckpt_path!r}.")
    if ckpt_path != "last":
        return ckpt_path
    found, fallbacks = last_path(trainer)
    side.resume_fallbacks = fallbacks
    if found is None:
        return ckpt_path
    return found.url if found.is_url else found.path
