"""Free the gradient shards right after the optimizer step where nothing can see them before ``zero_grad``.

Lightning's automatic optimization runs ``training_step`` (the whole forward) before ``zero_grad(set_to_none=True)``,
so the previous step's gradient shards (as large as the sharded parameters) would stay alive through the next
forward, which is often the step's peak. Between the optimizer step and that ``zero_grad`` Lightning calls
``on_train_batch_end``, ``on_train_batch_start``, ``training_step`` and ``on_before_zero_grad``: where neither the
module nor a user callback overrides one of those hooks (Lightning's and this package's own callbacks never read
gradients) and ``zero_grad`` is torch's and Lightning's default, the gradients are freed at once, exactly as the
coming ``zero_grad`` would free them. Reading ``.grad`` elsewhere before that ``zero_grad`` (inside ``training_step``,
in a validation hook during ``fit``, after ``fit``) sees ``None`` instead of the stale values (the README says
so). The planner counts it (:class:`~lightning_vitscale.memory.step_model.TrainingLoop` ``released_after_step``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback, LightningModule

_MODULE_HOOKS = ("optimizer_zero_grad", "on_before_zero_grad", "on_train_batch_end", "on_train_batch_start")
_CALLBACK_HOOKS = ("on_before_zero_grad", "on_train_batch_end", "on_train_batch_start")
_TRUSTED = ("lightning.", "lightning_vitscale.")  # callbacks known not to read gradients


def _overrides(obj: object, base: type, hooks: tuple[str, ...]) -> bool:
    return any(getattr(type(obj), hook, None) is not getattr(base, hook) for hook in hooks)


def may_release_after_step(module: Any, trainer: pl.Trainer) -> bool:
    """Whether the gradients of ``module`` may be freed right after the optimizer step of ``trainer`` (its callbacks
    and optimizers) without anything observable changing (see the module docstring)."""
    if not isinstance(module, LightningModule) or not module.automatic_optimization:
        return False
    if _overrides(module, LightningModule, _MODULE_HOOKS):
        return False
    if any(_overrides(cb, Callback, _CALLBACK_HOOKS) for cb in trainer.callbacks  # type: ignore[attr-defined]
           if not type(cb).__module__.startswith(_TRUSTED)):
        return False
    inner = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
    return all(type(o).zero_grad is torch.optim.Optimizer.zero_grad for o in inner)


def release_gradients(optimizer: torch.optim.Optimizer) -> None:
    """What ``optimizer.zero_grad(set_to_none=True)`` does: its parameters' gradients become ``None``."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
