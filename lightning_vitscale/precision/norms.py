"""Normalization layers kept in fp32 inside a low-precision model, at one extra collective per step.

FAIR's finding: bf16 trains ViTs with fp32 hyper-parameters only if norms stay in fp32. One FSDP unit per norm
would triple the all-gathers; instead norm parameters leave the bf16 units as fp32 DTensors *replicated* on every
rank (tiny; optimizers, clipping and DCP see DTensors as elsewhere). A wrapped forward computes on local fp32
tensors and inputs and casts the output back; one coalesced all-reduce averages the gradients at the end of any
backward that handed one over (a raw ``loss.backward()`` too, as DDP's hooks do).

Eager, the forward computes on a plain fp32 leaf aliasing each parameter's local tensor, and a hook hands its
gradient over: ``to_local()``/``from_local`` cost an autograd function per parameter each way (ViT-H's 130 norm
parameters: ~12 ms of host time per step on CPU).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from lightning_vitscale._compat import (
    current_backward_id,
    dtensor_like,
    dtensor_local,
    parameter_slots,
    queue_end_of_backward,
    tree_map,
)
from lightning_vitscale.distributed.mesh import all_reduce_over, replicated_placements
from lightning_vitscale.precision.casting import first_floating_dtype, to_dtype

_PARAMS = "_vitscale_fp32_params"
_DTYPE = "_vitscale_norm_dtype"
_BASE = "_vitscale_norm_class"  # on the fp32 class (_fp32_class): the norm's own class, whose forward runs
_OWNER = "_vitscale_norms"  # on a converted norm: a weak reference to its ReplicatedNorms


class ReplicatedNorms:
    """fp32 norm layers held outside the FSDP units; owns their fp32 forward and their gradient reduction."""

    def __init__(self, modules: list[nn.Module], mesh: DeviceMesh, dtype: torch.dtype = torch.float32) -> None:
        self.mesh, self.dtype = mesh, dtype
        self.params: list[nn.Parameter] = []
        self.syncing = True  # False on the micro-batches before the last of an accumulation window
        self._queued_in = -1  # the backward in which an end-of-backward reduction was queued (a raising one's too)
        self._reduced_at_end = False  # one ran since the last after_backward()
        self.zero_unused = False  # find_unused_parameters=True: a norm unused here sends a zero gradient
        self.filled: list[bool] = []  # which params the last reduction gave zeros (unused here), in `params` order
        for module in modules:
            self._convert(module)

    def gradient_arrived(self) -> None:
        """A norm's gradient arrived (handed over eager, accumulated compiled): average them all when this backward
        ends, however it was called. Once per backward."""
        backward = current_backward_id()
        if backward != self._queued_in:
            self._queued_in = backward
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        if self.syncing:
            self.reduce_grads()
            self._reduced_at_end = True

    def after_backward(self) -> None:
        """Lightning's post-backward: average unless the backward's end did (averaging equal values is harmless)."""
        if self._reduced_at_end:
            self._reduced_at_end = False
        elif self.syncing:
            self.reduce_grads()

    def _convert(self, module: nn.Module) -> None:
        originals = {}
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = self.replicate(param, self.dtype)
            module.register_parameter(name, replicated)
            originals[name] = replicated
        self.hold(module, originals)
        setattr(module, _DTYPE, self.dtype)
        module.__class__ = _fp32_class(type(module))

    def replicate(self, param: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
        """``param``'s values as a parameter of ``dtype`` replicated on every rank, averaged with the norms'
        gradients (also 0-dim ones, which FSDP2 cannot shard: ``sharding/scalar_parameters.py``)."""
        local = param.detach().to(dtype)
        placements = replicated_placements(self.mesh)
        replicated = nn.Parameter(DTensor.from_local(local, self.mesh, placements, run_check=False))
        # Compiled norms accumulate here (eager ones: _hand_gradient). Hooked while requiring grad (a hook needs
        # it), then frozen as the original: a norm unfrozen later is followed.
        replicated.register_post_accumulate_grad_hook(functools.partial(_arrived, weakref.ref(self)))
        replicated.requires_grad_(param.requires_grad)
        self.params.append(replicated)
        return replicated

    def hold(self, module: nn.Module, replicated: dict[str, nn.Parameter]) -> None:
        """``module`` computes on leaves of these parameters (:func:`compute_leaf`), whose gradients are handed to
        them and averaged by this object."""
        setattr(module, _PARAMS, replicated)
        setattr(module, _OWNER, weakref.ref(self))

    def ignored(self) -> set[nn.Parameter]:
        return set(self.params)

    @staticmethod
    def leaf_of(param: torch.Tensor) -> torch.Tensor | None:
        """The leaf a norm's forward computed with for ``param`` (one of :attr:`params`), if one did: what a step's
        graph holds for it (``torch.autograd.grad(loss, self.parameters())``)."""
        return _LEAVES.get(dtensor_local(param))

    @torch.no_grad()
    def reduce_grads(self) -> int:
        """Average the norm gradients over the mesh, one coalesced collective per mesh dimension; returns how many."""
        if self.mesh.size() == 1:
            return 0
        if self.zero_unused:  # every rank sends every norm's gradient, or the all-reduces differ in size
            self.filled = [param.grad is None and param.requires_grad for param in self.params]
            for param, fill in zip(self.params, self.filled):
                if fill:
                    param.grad = torch.zeros_like(param)
        grads = [cast(DTensor, p.grad).to_local() for p in self.params if p.grad is not None]  # DTensors' grads
        if not grads:
            return 0
        reals = [torch.view_as_real(g) if g.is_complex() else g for g in grads]  # a complex one: its two parts
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in reals])
        all_reduce_over(flat, self.mesh)  # SUM: gloo has no AVG
        flat.div_(self.mesh.size())
        for grad, chunk in zip(reals, flat.split([g.numel() for g in reals])):
            grad.copy_(chunk.view_as(grad))
        return sum(1 for dim in range(self.mesh.ndim) if self.mesh.size(dim) > 1)


_FP32_CLASSES: dict[type, type] = {}


def _fp32_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with :func:`_fp32_forward` as its forward (as FSDP2's ``FSDP<cls>``), same ``__name__``. A class,
    not an instance ``forward``: dynamo guards on its identity, so every compiled block after the first recompiled."""
    return strategy_class(cls, {"forward": _fp32_forward}, _FP32_CLASSES)


def strategy_class(cls: type[nn.Module], attrs: dict[str, Any], made: dict[type, type]) -> type[nn.Module]:
    """``cls`` with ``attrs`` on a subclass of the same name, one per class (cached in ``made``), that
    :func:`plain_norm_class` undoes (a deep copy shows the module's own class)."""
    if cls not in made:
        own = {_BASE: cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        made[cls] = type(cls.__name__, (cls,), {**attrs, **own})
    return made[cls]


def plain_norm_class(cls: type) -> type:
    """The module's own class behind one of :func:`strategy_class` (the fp32 norms', a 0-dim parameter owner's);
    any other class as it is."""
    return vars(cls).get(_BASE, cls)


def held_parameters(module: nn.Module) -> dict[str, nn.Parameter] | None:
    """The replicated parameters ``module`` computes on leaves of (:meth:`ReplicatedNorms.hold`), by attribute."""
    return module.__dict__.get(_PARAMS)


def _fp32_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A converted norm's forward: its class's forward on local fp32 parameters and inputs; the gradient lands on
    the DTensor parameter (:func:`compute_leaf` eager, the free ``to_local()`` compiled).

    A forward, not hooks, all read from the module and its class: dynamo guards on anything bound per norm, so
    identical compiled blocks would stop sharing a graph. ``finally``: a raising forward must not leave local tensors
    as parameters. The one-tensor path skips the pytree walks (a third of this function's host time).
    """
    params: dict[str, DTensor] = getattr(module, _PARAMS)
    norm_dtype: torch.dtype = getattr(module, _DTYPE)
    single = not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor)
    if single:
        out_dtype = args[0].dtype if args[0].is_floating_point() else None
        args = (args[0].to(norm_dtype),) if out_dtype is not None else args
    else:
        out_dtype = first_floating_dtype(args, kwargs)
        to_norm_dtype = to_dtype(norm_dtype)
        args, kwargs = tree_map(to_norm_dtype, args), tree_map(to_norm_dtype, kwargs)
    slots = parameter_slots(module)
    if not isinstance(slots.get(next(iter(params), "")), DTensor):  # one rank's compute copies are in place
        output = getattr(type(module), _BASE).forward(module, *args, **kwargs)
    else:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            local = {name: param.to_local() for name, param in params.items()}  # no autograd node without grad
        else:
            local = {name: compute_leaf(module, name, param) for name, param in params.items()}
        slots.update(local)
        try:
            output = getattr(type(module), _BASE).forward(module, *args, **kwargs)
        finally:
            slots.update(params)
    if out_dtype is None:
        return output
    if isinstance(output, torch.Tensor):
        return output.to(out_dtype) if output.is_floating_point() else output
    return tree_map(to_dtype(out_dtype), output)


# A parameter's local tensor -> its norm's leaf. Keyed by the local tensor, so a replaced one (``module.to()``,
# ``swap_tensors``, a deep copy) gets a new leaf, never a stale alias; weak, so a dropped model takes its leaves.
_LEAVES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def compute_leaf(module: nn.Module, name: str, param: DTensor) -> torch.Tensor:
    """A leaf sharing ``param``'s local storage and version counter (updates show, recompute sees the same tensor),
    requiring grad as ``param`` does now. Its hook refers weakly to the module, not the parameter:
    ``swap_tensors`` (``module.to()``) refuses weakly referenced tensors."""
    local = dtensor_local(param)
    leaf = _LEAVES.get(local)
    if leaf is None:
        leaf = _LEAVES[local] = local.detach()
    if leaf.requires_grad != param.requires_grad:
        leaf.requires_grad_(param.requires_grad)
        if param.requires_grad and not getattr(leaf, "_vitscale_hooked", False):  # a hook needs requires_grad
            leaf.register_post_accumulate_grad_hook(functools.partial(_hand_gradient, weakref.ref(module), name))
            leaf._vitscale_hooked = True  # type: ignore[attr-defined]
    return leaf


def _hand_gradient(module_ref: weakref.ref, name: str, leaf: torch.Tensor) -> None:
    """Move ``leaf``'s gradient onto its DTensor parameter, summing into one already there, as autograd would."""
    grad, leaf.grad = leaf.grad, None
    module = module_ref()
    if grad is None or module is None:
        return
    param = getattr(module, _PARAMS)[name]
    if param.grad is None:
        param.grad = dtensor_like(grad, param)
    else:
        dtensor_local(param.grad).add_(grad)
    _arrived(getattr(module, _OWNER), param)


def _arrived(owner_ref: weakref.ref, _param: torch.Tensor) -> None:
    owner = owner_ref()
    if owner is not None:
        owner.gradient_arrived()
