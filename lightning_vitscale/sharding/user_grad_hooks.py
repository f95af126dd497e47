"""Gradient hooks a model registers on its parameters (``p.register_hook(fn)`` in ``__init__`` or
``configure_model``: a mask freezing some rows of a weight, a token frozen by a zero, a gradient scaled per layer) act
as under DDP, on the gradient of the whole parameter on each rank, before it is averaged over the ranks.

Sharding replaces each parameter by a new one (FSDP2's DTensor, the row shards of one rank's compute copies, a
norm's replicated copy), which carries no hook, and autograd computes each gradient for yet another tensor (the
gathered parameter, the compute copy, a norm's leaf): a hook registered on the model's parameter never ran, and the
gradients it would have changed trained the model, silently (2 ranks: a token "frozen" by its hook moved by 0.013, the
masked rows by 0.006, where DDP's stay put). So the hooks are taken from the parameters before sharding and registered
on the tensor each gradient is computed for, once each: the compute copies at setup; the gathered parameters (which
FSDP2 keeps from its first all-gather on) and the norms' leaves when the module holding them first runs in a step. A
hook registered on a sharded parameter after setup is refused (``AssignableDTensor.register_hook``), naming this."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import parameter_slots, tensor_backward_hooks
from lightning_vitscale.precision.norms import compute_leaf, held_parameters

Hook = Callable[[torch.Tensor], Any]


class UserGradientHooks:
    """The hooks of each ``(module, name)`` parameter slot that had any before sharding, and the tensors they were
    registered on since (by id, with the tensor kept alive so that its id is not reused)."""

    def __init__(self, owners: list[tuple[nn.Module, str, list[Hook]]]) -> None:
        self.owners = owners
        self._of_module: dict[int, list[tuple[str, list[Hook]]]] = {}  # a module's hooked slots, for its pre-hook
        for module, name, hooks in owners:
            self._of_module.setdefault(id(module), []).append((name, hooks))
        self._hooked: dict[int, torch.Tensor] = {}

    @classmethod
    def taken_from(cls, model: nn.Module) -> UserGradientHooks | None:
        """The hooks on ``model``'s parameters now (before sharding replaces them); ``None`` where there are none."""
        owners = [(module, name, hooks) for module in model.modules()
                  for name, param in module.named_parameters(recurse=False)
                  if (hooks := tensor_backward_hooks(param))]
        return cls(owners) if owners else None

    def install(self, outer: nn.Module, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Register the hooks where gradients will be computed. ``copies``: (sharded parameter, its compute copy)
        pairs of one rank's compute copies, which live as long as the model; ``outer``: the module Lightning calls
        for a step, gathered by its forward's start. The forward pre-hooks placed live with the model, as the outer
        unit's own do."""
        copy_of = {id(param): copy for param, copy in copies}
        for module, name, hooks in self.owners:
            copy = copy_of.get(id(parameter_slots(module)[name]))
            if copy is not None:
                self._register(copy, hooks)
        outer.register_forward_pre_hook(lambda *_: self.attach_gathered())
        for module in {id(module): module for module, _, _ in self.owners}.values():
            module.register_forward_pre_hook(self._attach_module)

    def attach_gathered(self) -> None:
        """Each slot holding a gathered parameter now (the outer unit's, as a step starts), or a replicated one (a
        norm's, a 0-dim parameter's leaf), gets its hooks."""
        for module, name, hooks in self.owners:
            self._register(_computed_for(module, name), hooks)

    def _attach_module(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for name, hooks in self._of_module[id(module)]:
            self._register(_computed_for(module, name), hooks)

    def _register(self, tensor: torch.Tensor | None, hooks: list[Hook]) -> None:
        if tensor is None or isinstance(tensor, DTensor) or id(tensor) in self._hooked or not tensor.requires_grad:
            return
        for hook in hooks:
            tensor.register_hook(hook)
        self._hooked[id(tensor)] = tensor


def _computed_for(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor a step computes ``module.<name>``'s gradient for now: the slot's (a gathered parameter, a compute
    copy), or for a replicated one (a norm's, a 0-dim parameter's) its leaf; a DTensor where none is."""
    tensor = parameter_slots(module)[name]
    held = held_parameters(module)
    if isinstance(tensor, DTensor) and held is not None and name in held:
        return compute_leaf(module, name, cast(DTensor, held[name]))
    return tensor
