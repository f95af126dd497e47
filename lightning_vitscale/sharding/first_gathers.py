"""A unit's first gather made outside inference mode, whatever mode the call that needs it runs in.

FSDP2 makes the tensors a unit gathers into (its gathered parameters) at the unit's first gather and keeps them for
the run. Made inside ``torch.inference_mode`` they are inference tensors, and every training step after fails
("Inference tensors do not track version counter", or "Inplace update to inference tensor outside InferenceMode";
torch's FSDP2 alone fails the same way). Lightning runs ``trainer.validate``, ``test`` and ``predict`` in inference
mode wherever the backend is not gloo (NCCL: every GPU run), so ``trainer.validate(model)`` before
``trainer.fit(model)``, DDP users' baseline, broke the fit; so did ``with torch.inference_mode(): model(x)`` in a step
or a hook before the first step. DDP's parameters are made once, outside any mode.

So the first call that would gather in inference mode (a unit's forward, the outer unit gathered for a call outside
a step, a unit gathered ahead of its call) first gathers every unit not yet gathered, outside inference mode, one
at a time, and reshards it; gathers in inference mode then copy into ordinary tensors. A unit whose forward first
runs outside inference mode (every unit of a run that trains first) is gathered there as usual and its check
removed: after the first training step no hook is left. Not at setup: gathering every unit there would hold one
gathered unit beside the shards, which sharded creation promises not to (``tests/distributed/test_creation.py``).
Every rank makes these gathers at the same call: evaluation and such calls run on every rank (one rank alone is
refused before, ``in_step_calls.py`` and the outer unit's agreement).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_vitscale.sharding import gather_checks


class FirstGathers:
    """``units`` (every FSDP unit: the outer one and the blocks', in model order) not yet gathered outside inference
    mode, each with a forward pre-hook that runs before FSDP2's. ``gather``: gathers and reshards the units it is
    given, outside inference mode (``fsdp.gathered_and_resharded``)."""

    def __init__(self, units: list[nn.Module], gather: Callable[[list[nn.Module]], None]) -> None:
        self._order, self._gather = list(units), gather
        self._handles: dict[int, RemovableHandle] = {}
        for unit in units:
            self._handles[id(unit)] = unit.register_forward_pre_hook(functools.partial(self._called, unit),
                                                                     prepend=True)
            # where it is gathered other than by its own forward (gather_checks.py)
            gather_checks.register(unit, gather_checks.Concern.FIRST_GATHER, functools.partial(self.before, unit))

    def _called(self, unit: nn.Module, module: nn.Module, args: Any) -> None:
        self.before(unit)

    def before(self, unit: nn.Module) -> None:
        if torch.is_inference_mode_enabled():
            self._gather_pending()
        else:
            self._done(unit)  # gathered now, outside inference mode: ordinary tensors from here on

    @torch.compiler.disable
    def _gather_pending(self) -> None:
        pending = [unit for unit in self._order if id(unit) in self._handles]
        self._gather(pending)
        for unit in pending:
            self._done(unit)

    def _done(self, unit: nn.Module) -> None:
        handle = self._handles.pop(id(unit), None)
        if handle is not None:
            handle.remove()
            gather_checks.unregister(unit, gather_checks.Concern.FIRST_GATHER)
