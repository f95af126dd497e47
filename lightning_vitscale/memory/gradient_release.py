"""Free the gradient shards right after the optimizer step where nothing can see them before ``zero_grad``.

Lightning runs the next forward (often the step's peak) before ``zero_grad``. Where neither the module nor a user
callback overrides a hook called in between (Lightning's and this package's never read gradients) and ``zero_grad``
is the default, the shards are freed at once, as it would; ``.grad`` read elsewhere before it sees ``None`` (the
README says so).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer

_MODULE_HOOKS = ("optimizer_zero_grad", "on_before_zero_grad", "on_train_batch_end", "on_train_batch_start")
_CALLBACK_HOOKS = ("on_before_zero_grad", "on_train_batch_end", "on_train_batch_start")
_TRUSTED = ("lightning.", "lightning_vitscale.")  # callbacks known not to read gradients


def _overrides(obj: object, base: type, hooks: tuple[str, ...]) -> bool:
    return any(getattr(type(obj), hook, None) is not getattr(base, hook) for hook in hooks)


def may_release_after_step(module: Any, trainer: pl.Trainer) -> bool:
    """Whether ``module``'s gradients may be freed right after ``trainer``'s optimizer step (module docstring)."""
    if not isinstance(module, LightningModule) or not module.automatic_optimization:
        return False
    if _overrides(module, LightningModule, _MODULE_HOOKS):
        return False
    if any(_overrides(cb, Callback, _CALLBACK_HOOKS) for cb in trainer.callbacks  # type: ignore[attr-defined]
           if not type(cb).__module__.startswith(_TRUSTED)):
        return False
    return all(type(unwrapped(o)).zero_grad is torch.optim.Optimizer.zero_grad for o in trainer.optimizers)


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer behind a ``LightningOptimizer`` (what ``self.optimizers()`` hands out)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def release_gradients(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``."""
    for group in unwrapped(optimizer).param_groups:
        for param in group["params"]:
            param.grad = None
