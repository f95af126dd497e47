"""Calls of a block inside a step that not every rank makes, refused before they gather.

DDP's forward is local, so ``if trainer.is_global_zero: preds = self(images)`` in ``validation_step`` (sample
images for a logger) just runs. Here every call of a block unit may all-gather its shards (a collective), and a call
one rank makes alone pairs its gathers with whatever collectives the other ranks make next: measured on 2 gloo ranks
with every unit resharded, the other rank aborted ("terminate called after throwing gloo::EnforceNotMet", no Python
error) or the step timed out after ``VitScaleStrategy(timeout=...)``.

So each block's calls outside backward are counted per step, and a call past the most that every rank made in one
step before (one, at first) is a handshake first (``distributed/collective_guard.py``): where every rank makes it
(a backbone run on two crops, a block every layer shares) they agree once, in the first step, and the count becomes
the new most; where one rank makes it alone it fails before any gather, within seconds where the others went on
(a later batch, their backward), naming the fix. The first call per step is never guarded: where one rank's extra
call comes before the step's own, it is that rank's own call that fails, one call later. A rank's extra call whose
blocks stay gathered would have needed no collective; it is refused too, so that the same code does not fail only
under another plan (a bigger model, another memory budget). Not under ``find_unused_parameters``, where ranks call
different blocks by design (``"units"``: a skipped block stood in for where it would have run, ``skipped_blocks.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightning_vitscale._compat import current_backward_id
from lightning_vitscale.distributed import collective_guard
from lightning_vitscale.sharding import gather_checks
from lightning_vitscale.sharding.outer_unit_errors import in_step_call_error


class InStepCalls:
    """The calls of each block (``blocks``: name -> module, each in a block unit) in the current step, and the most
    every rank made in one step so far. ``root``: the module every step's forward enters first (the outer unit),
    where the count starts again; ``in_step``: whether a step is running (outside one the outer unit guards)."""

    def __init__(self, root: nn.Module, blocks: Mapping[str, nn.Module], in_step: Callable[[], bool]) -> None:
        self._calls: dict[str, int] = {}
        self._agreed: dict[str, int] = {}
        self._in_step = in_step
        self._blocks = list(blocks.values())
        self._handles = [root.register_forward_pre_hook(self._new_step)]
        for name, block in blocks.items():
            hook = functools.partial(self._before_call, name)
            self._handles.append(block.register_forward_pre_hook(hook, prepend=True))  # before FSDP2's gather
            # a gather ahead of the call (``fsdp.prefetch_on_entry``) asks for the call about to come, not counted yet
            gather_checks.register(block, gather_checks.Concern.LONE_CALL, functools.partial(self._check, name, 1))

    def _new_step(self, *unused: Any) -> None:
        self._calls.clear()

    def new_run(self) -> None:
        """A later Trainer's run of the same model (``trainer.validate()`` after ``fit``): its steps agree afresh, so a
        count agreed in the earlier run does not let a lone call through."""
        self._calls.clear()
        self._agreed.clear()

    def _before_call(self, name: str, *unused: Any) -> None:
        if self._check(name, 1):
            self._calls[name] = self._calls.get(name, 0) + 1

    def _check(self, name: str, coming: int) -> bool:
        """Whether a step runs (outside backward: not checkpointing's recompute); if so, agree first on the call
        ``coming`` calls of ``name`` from now where no step made that many before."""
        if not self._in_step() or current_backward_id() != -1:
            return False
        count = self._calls.get(name, 0) + coming
        if count > self._agreed.get(name, 1):
            try:
                collective_guard.agree(collective_guard.UNIT_CALL, count, collective_guard.fingerprint([name]))
            except collective_guard.NotJoinedError as error:
                raise in_step_call_error(name, count, error) from error
            self._agreed[name] = count
        return True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for block in self._blocks:
            gather_checks.unregister(block, gather_checks.Concern.LONE_CALL)
