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

A gradient taken for the parameters themselves (``torch.autograd.grad(loss, self.parameters())``: gradient-norm
regularization, a multi-task method weighting its losses by their gradients) names each block parameter as the
DTensor its unit left after the forward, which the graph never used (it computed with the gathered one): torch's
"appears to not have been used in the graph". Each such DTensor is differentiated for as the gathered parameter its
unit's forward used (an fp32 norm's: the leaf its forward computed with, ``precision/norms.py``): the gradients come
back whole and this rank's own, as under DDP (whose hooks see no ``torch.autograd.grad``), and FSDP2 gathers the
unit for that backward as for any. A backward given ``inputs=`` (a GAN's generator step restricted to its own
parameters) named the same DTensors, which it left unreached and silent: the block units then reduced zero gradients
and never trained (2 ranks: DDP's weights 8e-3 apart after 4 steps). Its inputs are mapped the same way, in the step
and in the strategy's backward; the gradients accumulate on the gathered parameters and FSDP2 reduces them as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import (
    gathered_of_shards,
    gradient_calls_seen,
    keep_units_gathered,
    queue_end_of_backward,
    unit_param_groups,
)
from lightning_vitscale.sharding.unit_members import reshard_units


class GradientsOfGradients:
    """``root``: the outer unit (FSDP2's path; one rank's compute copies keep their memory through the step);
    ``deferred``: its :class:`~.deferred_reduction.DeferredReduction`, paused while the units are kept."""

    def __init__(self, root: nn.Module, deferred: Any = None,
                 norm_leaf: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
        self._root = root
        self._deferred = deferred
        self._norm_leaf = norm_leaf  # the fp32 norms' parameters -> the leaves their forwards computed with
        self._groups: list[Any] | None = None  # the units' FSDP2 parameter groups, found at the first penalty
        self._restore: Callable[[], None] | None = None  # set while the units are kept gathered

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """The step's ``torch.autograd.grad`` keeps the units gathered when it builds a graph."""
        self.release()  # a step that kept them and ran no backward after: resharded before this one
        with gradient_calls_seen(self._before_gradients):
            yield

    @contextmanager
    def in_backward(self) -> Iterator[None]:
        """A backward's ``inputs=`` (``self.manual_backward(loss, inputs=...)``, a ``LightningModule.backward``
        passing them) named as the graph's tensors, as in the step."""
        with gradient_calls_seen(self._before_gradients):
            yield

    def _before_gradients(self, create_graph: bool, inputs: Any, accumulate: bool = False) -> Any:
        if create_graph and not accumulate and self._restore is None:
            self._restore = keep_units_gathered(self._unit_groups())
            if self._deferred is not None:
                self._deferred.pause()
        if not any(isinstance(tensor, DTensor) for tensor in inputs):
            return inputs
        gathered = gathered_of_shards(self._unit_groups())
        return tuple(self._in_graph(tensor, gathered) for tensor in inputs)

    def _in_graph(self, tensor: torch.Tensor, gathered: dict[int, nn.Parameter]) -> torch.Tensor:
        """The tensor the step's graph holds for ``tensor`` (itself, unless a shard or an fp32 norm's DTensor)."""
        if not isinstance(tensor, DTensor):
            return tensor
        found: torch.Tensor | None = gathered.get(id(tensor))
        if found is None and self._norm_leaf is not None:
            found = self._norm_leaf(tensor)
        return tensor if found is None else found

    def _unit_groups(self) -> list[Any]:
        if self._groups is None:
            self._groups = unit_param_groups(self._root)
        return self._groups

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


def naming_graph_inputs(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A strategy's ``backward(loss, ...)`` with its ``inputs=`` named as the graph's tensors
    (:meth:`GradientsOfGradients.in_backward`), where the strategy's model runs steps on FSDP2's path."""

    @functools.wraps(backward)
    def with_graph_inputs(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        twice = getattr(getattr(strategy, "sharded", None), "gradients_of_gradients", None)
        with twice.in_backward() if twice is not None else nullcontext():
            return backward(strategy, *args, **kwargs)

    return with_graph_inputs
