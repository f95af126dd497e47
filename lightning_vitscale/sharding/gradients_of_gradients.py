"""Gradients of gradients in a training step (WGAN-GP's gradient penalty, StyleGAN's R1, input-gradient
regularizers: ``torch.autograd.grad(..., create_graph=True)``), as under DDP.

FSDP2 ends every backward with its root post-backward, which reshards each unit gathered for it, and reshards a unit
after each forward unless it is kept for backward. A backward with ``create_graph=True`` records a graph of its own
whose nodes keep the gathered parameters (a linear's weight, for the gradient of its input's gradient); the loss's
backward then runs those nodes, and no unit's pre-backward hook gathers them again first: torch's "setStorage: ...
out of bounds for storage of size 0" (pytorch#172543; FSDP2's answer is ``set_reshard_after_backward(False)``).

So inside a step, ``torch.autograd.grad`` called with ``create_graph=True`` leaves every unit gathered from then on,
through the step's forwards and the next backward (the loss's: ``manual_backward`` or Lightning's), at whose end
each unit gets its own settings back and is resharded. The gradients are reduced as usual, at each unit's
post-backward. Memory: the units stay whole from the penalty to the end of that backward (as DDP's model always is).
The step's calls are seen below ``torch.autograd.grad`` (``_compat.gradient_calls_seen``), so a ``grad`` imported
before the step (``from torch.autograd import grad``, as WGAN-GP code often has it) is seen too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import (
    gradient_calls_seen,
    keep_units_gathered,
    queue_end_of_backward,
    unit_param_groups,
)
from lightning_vitscale.sharding.unit_members import reshard_units


class GradientsOfGradients:
    """``root``: the outer unit (FSDP2's path; one rank's compute copies keep their memory through the step);
    ``deferred``: its :class:`~.deferred_reduction.DeferredReduction`, paused while the units are kept."""

    def __init__(self, root: nn.Module, deferred: Any = None) -> None:
        self._root = root
        self._deferred = deferred
        self._groups: list[Any] | None = None  # the units' FSDP2 parameter groups, found at the first penalty
        self._restore: Callable[[], None] | None = None  # set while the units are kept gathered

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """The step's ``torch.autograd.grad`` keeps the units gathered when it builds a graph."""
        self.release()  # a step that kept them and ran no backward after: resharded before this one
        with gradient_calls_seen(self._before_gradients):
            yield

    def _before_gradients(self, create_graph: bool) -> None:
        if create_graph and self._restore is None:
            if self._groups is None:
                self._groups = unit_param_groups(self._root)
            self._restore = keep_units_gathered(self._groups)
            if self._deferred is not None:
                self._deferred.pause()

    def before_backward(self, loss: torch.Tensor) -> None:
        """The loss's backward, after a gradient of a gradient: at its end (after FSDP2's own end, which the first
        callback queues behind itself), the units' settings back and the units resharded."""
        if self._restore is not None and loss.requires_grad:
            loss.register_hook(_at_end_of_backward(self.release))

    def release(self) -> None:
        if self._restore is None:
            return
        restore, self._restore = self._restore, None
        restore()
        reshard_units(self._root)
        if self._deferred is not None:
            self._deferred.resume()


def _at_end_of_backward(callback: Callable[[], None]) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        queue_end_of_backward(lambda: queue_end_of_backward(callback))  # after FSDP2's root post-backward

    return hook
