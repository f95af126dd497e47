"""The global random states around the planner's runs: what the planner draws is undone, what the run's own trainer
draws for it is kept.

The planner fetches a batch (random crops, a sampler's seed) and runs the step (dropout, random augmentations) at
setup, which DDP never does: every state it touches is restored after (:func:`random_state_kept`), or the run's
numbers would shift. But the step may read the real trainer through the planner's stand-in, and some reads act for
the run: ``self.trainer.estimated_stepping_batches`` (a OneCycle schedule's length, read in
``configure_optimizers``) sets up the train dataloader and draws its iterator's base seed once, as DDP's setup does
when Lightning calls ``configure_optimizers``; Lightning does not set it up again. Restored with the planner's own
draws, that draw was lost: one draw fewer than under DDP, every dropout mask after it different (2 ranks or one, a
silent difference from the first step's loss). So such a read runs :func:`as_the_run`: from the states outside the
planner's run, and what it draws stays drawn when the planner's run ends.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_vitscale._compat import disable_current_modes


@dataclass(eq=False)  # by identity: its states are tensors
class _States:
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor]
    python: Any
    numpy: Any

    @classmethod
    def now(cls, devices: list[int]) -> _States:
        import numpy.random  # torchmetrics requires NumPy

        cuda = [torch.cuda.get_rng_state(device) for device in devices]
        return cls(torch.get_rng_state(), cuda, random.getstate(), numpy.random.get_state())

    def restore(self, devices: list[int]) -> None:
        import numpy.random

        torch.set_rng_state(self.torch_cpu)
        for device, state in zip(devices, self.torch_cuda):
            torch.cuda.set_rng_state(state, device)
        random.setstate(self.python)
        numpy.random.set_state(self.numpy)


@dataclass(eq=False)  # by identity: its states are tensors
class _Kept:
    outside: _States
    devices: list[int]


_KEPT: list[_Kept] = []  # the planner's runs in progress, innermost last


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """torch's (CPU, initialised CUDA devices), Python's and NumPy's global random states as they were before the body,
    after it, but for what :func:`as_the_run` drew in it."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    kept = _Kept(_States.now(devices), devices)
    _KEPT.append(kept)
    try:
        yield
    finally:
        _KEPT.remove(kept)
        kept.outside.restore(kept.devices)


@contextlib.contextmanager
def as_the_run() -> Iterator[None]:
    """The body runs as the run's own code: outside the planner's fake-tensor modes (a draw there is symbolic and
    leaves the generator as it was), from the random states outside the planner's run, and its draws stay: the states
    after the planner's run are as if the body ran before it. Outside a planner's run: the body, as is."""
    if not _KEPT:
        yield
        return
    kept = _KEPT[0]  # the outermost: its states are the run's
    with disable_current_modes():
        inside = _States.now(kept.devices)
        kept.outside.restore(kept.devices)
        try:
            yield
        finally:
            kept.outside = _States.now(kept.devices)
            inside.restore(kept.devices)
