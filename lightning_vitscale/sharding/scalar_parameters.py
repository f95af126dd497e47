"""0-dim parameters (a learnable temperature: CLIP's and open_clip's ``logit_scale``) and complex ones (a Fourier
neural operator's spectral weights, ``torch.cfloat``), which FSDP2 cannot shard ("fully_shard doesn't support scalar
parameters"; "FSDP expects uniform original parameter dtype but got {torch.float32, torch.complex64}"), trained as
DDP trains them.

They are held as the fp32 norms are (``precision/norms.py``): replicated DTensors outside the FSDP units, in their
own dtype, each rank's gradient averaged at the end of backward in the norms' one all-reduce, so their values and the
optimizer's state on them stay equal on every rank. The model's code mixes such a parameter with plain tensors
(``logits * self.logit_scale.exp()``), which a DTensor refuses; so the module holding it shows, while a computation
runs, a plain tensor aliasing the parameter's local value (its storage and version counter: an update shows, an
in-place write lands) whose gradient is handed over to the parameter, and at any other time the parameter itself,
as DDP shows it: what ``configure_optimizers`` collects, what a callback clamps in place or freezes, what checkpoints
hold (shape ``()``, as DDP's).

A computation is a call into the model or into any module above an owner (a step, through Lightning's forward
redirection into the LightningModule; a call outside one), or a backward (checkpointing's recompute runs the block's
forward there, not its ``__call__``). The owner's class gains a ``__getattr__`` (a subclass of the same name, undone
by a deep copy as the norms' class is); parameters live in ``_parameters``, so reading one goes through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import current_backward_id, parameter_slots
from lightning_vitscale._utils import self_and_ancestors
from lightning_vitscale.precision.norms import (
    ReplicatedNorms,
    compute_leaf,
    held_parameters,
    strategy_class,
)


class _Computing:
    """How deep the calls into modules above a 0-dim parameter's owner are nested (any model's: a conservative
    flag, read on each attribute read of an owner)."""

    depth = 0


def find_unshardable_parameters(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, owner, attribute) of each 0-dim or complex parameter slot, a tied one once per owner;
    parameters already held replicated (a norm's) are left out."""
    found = []
    for prefix, module in model.named_modules():  # a module held twice: once
        held = held_parameters(module) or {}
        for attr, param in parameter_slots(module).items():
            if param is not None and (param.dim() == 0 or param.is_complex()) and attr not in held:
                found.append((f"{prefix}.{attr}" if prefix else attr, module, attr))
    return found


def replicate_unshardable(
    model: nn.Module, found: list[tuple[str, nn.Module, str]], replicas: ReplicatedNorms
) -> None:
    """Hold each found parameter replicated by ``replicas`` (its values prepared already), its owner showing a
    leaf of it during computations (forward hooks on the owners and their callers mark those; kept for the
    model's life, and a deep copy drops them as the strategy's)."""
    made: dict[int, nn.Parameter] = {}
    owners: dict[int, nn.Module] = {}
    for _, owner, attr in found:
        param = parameter_slots(owner)[attr]
        assert param is not None
        if id(param) not in made:
            made[id(param)] = replicas.replicate(param, param.dtype)
        owner.register_parameter(attr, made[id(param)])
        held = held_parameters(owner)
        replicas.hold(owner, {**(held or {}), attr: made[id(param)]})
        owner.__class__ = _owner_class(type(owner))
        owners[id(owner)] = owner
    for module in self_and_ancestors(model, set(owners)):  # where a computation reading them can start
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)


def _enter(module: nn.Module, args: Any) -> None:
    _Computing.depth += 1


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    _Computing.depth = max(0, _Computing.depth - 1)


_OWNER_CLASSES: dict[type, type] = {}


def _owner_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls in _OWNER_CLASSES.values():
        return cls
    return strategy_class(cls, {"__getattr__": _shown_as(cls.__getattr__)}, _OWNER_CLASSES)


def _shown_as(base_getattr: Callable[[nn.Module, str], Any]) -> Callable[[nn.Module, str], Any]:
    def __getattr__(self: nn.Module, name: str) -> Any:
        value = base_getattr(self, name)
        if isinstance(value, DTensor) and (_Computing.depth or current_backward_id() != -1):
            held = held_parameters(self)
            if held is not None and held.get(name) is value:
                return compute_leaf(self, name, value)
        return value

    return __getattr__
