"""A unit called several times a step (a backbone run on each crop size, a block every layer shares) reduces its
gradients once, after the backward of its first call, not after each call's.

Autograd sums a parameter's gradient over the calls that used it and writes it once, when the last backward reaching
it is done: the first call's (the calls' backward runs last call first). So FSDP2's post-backward of every later call
finds no gradient of this micro-batch. It reduced there anyway: on several ranks ``set_reduce_scatter_unused_params``
is on (``skipped_blocks.py``: a parameter one rank leaves unused must not shift the others' reduce-scatters), so a
zero gradient (DeiT-Tiny on two crop sizes, 2 ranks: 25 reduce-scatters a step where DDP's reduction needs 13, the
first pass's all zeros; benchmarks/RESULTS.md), and, accumulating micro-batches, the earlier micro-batches' sum
(reduced in two parts, each unit twice a step).

So every call of a unit after its first in a step turns the unit's gradient sync off for its own post-backward (FSDP2
then keeps what it has, as on a no-sync micro-batch) and restores it right after; the first call's post-backward, the
last to run, reduces everything once, a zero for a parameter no call used included. Watched from setup: where the
first backward finds every unit called once, the hooks are removed. Every rank makes the same calls (or FSDP2's
gathers would not match either), so every rank defers the same reductions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import current_backward_id, queue_end_of_backward, requires_gradient_sync


class _AroundPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs ``callback``: after FSDP2's post-backward of that call where
    applied before FSDP2's pre-forward (farther from the unit), before it where applied after."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class DeferredReduction:
    """Per step, the calls of each block unit with gradients on; see the module docstring. ``root``: the module every
    step's forward enters first (the outer unit), where the count starts again."""

    def __init__(self, root: FSDPModule, units: list[FSDPModule]) -> None:
        self._calls: dict[int, int] = {}
        # units whose sync is off now, with what to restore (a failed backward leaves them so until the next step)
        self._deferred: dict[int, tuple[FSDPModule, bool]] = {}
        self._handles = [cast(nn.Module, root).register_forward_pre_hook(self._new_step)]
        self.watching = True  # until a forward with gradients ran each unit at most once: then the hooks go
        self.paused = False  # units kept gathered for a gradient of a gradient (``gradients_of_gradients.py``)
        for unit in units:
            module = cast(nn.Module, unit)
            self._handles += [
                module.register_forward_pre_hook(functools.partial(self._before_fsdp, unit), prepend=True,
                                                 with_kwargs=True),
                module.register_forward_pre_hook(functools.partial(self._after_fsdp, unit), with_kwargs=True),
            ]

    def _new_step(self, *unused: Any) -> None:
        if self._calls and max(self._calls.values()) == 1:  # a forward with gradients called every unit once
            self._stop_watching()
        self._calls.clear()
        for unit, sync in self._deferred.values():
            unit.set_requires_gradient_sync(sync, recurse=False)
        self._deferred.clear()

    def pause(self) -> None:
        """Units kept gathered through a gradient of a gradient (``gradients_of_gradients.py``) reduce at each call's
        post-backward, as FSDP2 does, until :meth:`resume`: deferred to a first call's, a WGAN-GP critic with units
        of its own (called on the penalty's points, the fakes and the reals) trained apart from DDP from its second
        step on (2 ranks, ``tests/distributed/test_manual_optimization.py``); reduced at each call, DDP's numbers."""
        self.paused = True
        self._new_step()

    def resume(self) -> None:
        self.paused = False

    def _before_fsdp(self, unit: FSDPModule, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.paused or not torch.is_grad_enabled() or current_backward_id() != -1:  # see pause; no backward
            return None  # to come; a recompute
        first_in_backward = not self._calls
        calls = self._calls[id(unit)] = self._calls.get(id(unit), 0) + 1
        if calls > 1:
            return _wrapped(args, kwargs, functools.partial(self._restore, unit))
        # The first unit a forward calls: its backward ends the count (manual optimization's next forward, after a
        # backward in the same step, counts afresh). One autograd node a forward, not one a unit.
        return _wrapped(args, kwargs, self._count_again_after_backward) if first_in_backward else None

    def _after_fsdp(self, unit: FSDPModule, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.paused or not torch.is_grad_enabled() or current_backward_id() != -1:
            return None
        if self._calls.get(id(unit), 0) < 2:
            return None
        return _wrapped(args, kwargs, functools.partial(self._defer, unit))

    def _defer(self, unit: FSDPModule) -> None:
        self._deferred[id(unit)] = unit, requires_gradient_sync(unit)
        unit.set_requires_gradient_sync(False, recurse=False)

    def _restore(self, unit: FSDPModule) -> None:
        deferred = self._deferred.pop(id(unit), None)
        if deferred is not None:
            unit.set_requires_gradient_sync(deferred[1], recurse=False)

    def _count_again_after_backward(self) -> None:
        queue_end_of_backward(self._new_step)

    def _stop_watching(self) -> None:
        """The model calls each unit once a step (the common case): nothing to defer, so no hook per unit call and
        no autograd node per forward from here on (a model that calls a unit twice only later keeps FSDP2's zeros
        then, which cost bytes, not correctness)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.watching = False


def _wrapped(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict] | None:
    """``args``/``kwargs`` with their tensors that require gradients passed through one :class:`_AroundPostBackward`
    (FSDP2 registers its post-backward the same way, on the same tensors); ``None`` where none does."""
    positions = [i for i, value in enumerate(args) if isinstance(value, torch.Tensor) and value.requires_grad]
    names = [k for k, value in kwargs.items() if isinstance(value, torch.Tensor) and value.requires_grad]
    if not positions and not names:
        return None
    outputs = _AroundPostBackward.apply(callback, *(args[i] for i in positions), *(kwargs[k] for k in names))
    new_args, new_kwargs = list(args), dict(kwargs)
    for i, value in zip(positions, outputs[: len(positions)]):
        new_args[i] = value
    for k, value in zip(names, outputs[len(positions):]):
        new_kwargs[k] = value
    return tuple(new_args), new_kwargs
