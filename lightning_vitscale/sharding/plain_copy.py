"""``copy.deepcopy`` of a sharded model gives what DDP's gives: the plain module, whole parameters, no strategy.

The habits it serves: ``ema = copy.deepcopy(model)`` (timm's ``ModelEmaV3``), ``best = copy.deepcopy(model)`` in a
callback or after ``fit``, ``torch.save(model, path)`` (pickle: the file holds the plain module). Sharded, the modules
carry the strategy: FSDP2's unit classes (whose ``__deepcopy__`` refuses), the fp32 norms' class, hooks, wrapped
``forward`` s, DTensor parameters (and, inside a step, the compute copies or FSDP2's gathered parameters; tensor
parallelism's per-rank head counts and row order); a copy of that refused, or would compute on shards.

Every module of the sharded model with a parameter below it gets an instance ``__deepcopy__`` (``copy.deepcopy``
looks there before the class; the others copy as they are): it gathers each parameter whole onto its device (a
collective: after the handshake ``state_dict()`` makes, so a call on one rank fails, nothing sent), shows the
modules as they were before sharding for the length of the copy (class, ``forward``, none of the strategy's hooks
or attributes), and puts everything back.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import (
    PICKLE_NEWOBJ,
    PICKLE_RECONSTRUCTOR,
    gathered_to_sharded,
    hook_dicts,
    parameter_slots,
)
from lightning_vitscale.checkpoint.errors import StateDictGatherError
from lightning_vitscale.checkpoint.full_state_dict import full_tensor_on
from lightning_vitscale.distributed import collective_guard
from lightning_vitscale.precision.norms import plain_norm_class
from lightning_vitscale.row_layout import PACKED_ROWS, model_rows
from lightning_vitscale.sharding.tensor_parallel import SPLIT_ATTRIBUTES

_COPIER = "__deepcopy__"
_REDUCER = "__reduce_ex__"  # pickle (torch.save(model)) and copy.copy look it up on the instance too
_ABSENT = object()  # no instance ``forward`` before sharding
# What the strategy and FSDP2 leave in a module's __dict__: a plain module has none of it.
_STRATEGY_PREFIXES = ("_vitscale", "__composable_api_state_key_", "_is_fsdp_managed_module", "_fsdp_use_orig_params",
                      "_distribute_module_applied")
# Hooks whose code lives here are the strategy's (FSDP2's, tensor parallelism's, ours): a plain copy has none.
_STRATEGY_CODE = ("lightning_vitscale.", "torch.distributed.")


def record_forwards(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """Each module with its instance ``forward`` (or ``_ABSENT``) before sharding wraps some (checkpointing,
    compilation, attention routing)."""
    return [(module, module.__dict__.get("forward", _ABSENT)) for module in model.modules()]


def install(before: list[tuple[nn.Module, Any]], outer: nn.Module) -> None:
    """Give every module recorded by :func:`record_forwards` with a parameter below it its plain ``__deepcopy__``
    and ``__reduce_ex__`` (pickle, ``copy.copy``); ``outer``: the outer unit (its compute copies, its FSDP units'
    gathered parameters)."""
    outer_ref = weakref.ref(outer)
    for module, forward in before:
        # Not where nothing is sharded below (metrics, activations): a copy of those is a plain one, and a weak
        # reference kept to a torchmetrics metric, whose hash follows its state, would keep a stale hash for torch's
        # WeakKeyDictionary lookups (ModuleTracker: KeyError) once the metric updates.
        if next(module.parameters(), None) is not None:
            copier = module.__dict__[_COPIER] = _PlainCopier(module, forward, outer_ref)
            module.__dict__[_REDUCER] = copier.reduce


class _PlainCopier:
    """A module's instance ``__deepcopy__`` (see the module docstring); ``forward``: the module's before sharding."""

    def __init__(self, module: nn.Module, forward: Any, outer: weakref.ref[nn.Module]) -> None:
        self.module, self.forward, self.outer = weakref.ref(module), forward, outer

    def __call__(self, memo: dict[int, Any]) -> nn.Module:
        module = self.module()
        if module is None:
            raise RuntimeError("copy.deepcopy of a module that no longer exists")
        modules = list(module.modules())
        with torch.no_grad():
            _gather_into(memo, modules, self.outer())
        with _shown_plain(modules):
            return copy.deepcopy(module, memo)

    def reduce(self, protocol: int) -> Any:
        """``torch.save(model)`` (pickle) and ``copy.copy``: the plain copy's reduction, so the file holds DDP's plain
        module (a shallow copy is a plain one too: a sharded one would share the strategy's hooks and shards).

        Where the strategy gave the module a class of its own (a 0-dim parameter's owner, an fp32 norm), pickle
        refuses ``copyreg.__newobj__`` of another class than the object's ("args[0] from __newobj__ args has the
        wrong class"): the plain class is then rebuilt by ``copyreg._reconstructor``, stdlib as ``__newobj__``, so
        the file still loads without this package."""
        reduced = self({}).__reduce_ex__(protocol)
        module = self.module()
        if (isinstance(reduced, tuple) and reduced[0] is PICKLE_NEWOBJ and module is not None
                and reduced[1][0] is not type(module)):
            return (PICKLE_RECONSTRUCTOR, (reduced[1][0], object, None), *reduced[2:])
        return reduced


def _gather_into(memo: dict[int, Any], modules: list[nn.Module], outer: nn.Module | None) -> None:
    """``memo``: each parameter slot's value -> a plain ``nn.Parameter`` holding the whole parameter, on its device;
    slots ``memo`` already maps (a meta twin's stand-ins) are left alone."""
    sharded_of = _gathered_to_sharded(outer)
    pending: dict[int, tuple[DTensor, nn.Module]] = {}
    for module in modules:
        for value in parameter_slots(module).values():
            if value is None or id(value) in memo or id(value) in pending:
                continue
            sharded = value if isinstance(value, DTensor) else sharded_of.get(id(value))
            if sharded is not None:
                pending[id(value)] = (sharded, module)
    if not pending:
        return
    shapes = [f"{type(module).__name__}:{tuple(sharded.shape)}" for sharded, module in pending.values()]
    try:
        collective_guard.agree(collective_guard.DEEPCOPY, len(shapes), collective_guard.fingerprint(shapes))
        for key, (sharded, module) in pending.items():
            memo[key] = nn.Parameter(_whole(sharded, module), requires_grad=sharded.requires_grad)
    except RuntimeError as error:
        raise StateDictGatherError(collective_guard.not_joined(
            "copy.deepcopy() (or torch.save(model), copy.copy) of a model sharded by VitScaleStrategy gathers every"
            " parameter whole", error,
            "Make the copy on every rank (as each rank's model is copied under DDP), or make it before the strategy"
            " shards the model (in `setup()`), or build the module and load `model.state_dict()` (called on every"
            " rank) into it.",
        )) from error


def _whole(sharded: DTensor, module: nn.Module) -> torch.Tensor:
    """The whole parameter on the device its shard is on (host memory for ``offload="cpu"``), in the model's rows."""
    whole = full_tensor_on(sharded, sharded.device)  # a tensor of its own, never the live shard
    packed = module.__dict__.get(PACKED_ROWS)  # a projection packed for tensor parallelism: per-rank row order
    return (model_rows(whole, *packed) if packed is not None else whole).detach()


def _gathered_to_sharded(outer: nn.Module | None) -> dict[int, DTensor]:
    """Inside a step the modules may hold the one-rank compute copies, or FSDP2's gathered parameters: by id, the
    DTensor parameter each stands for."""
    found: dict[int, DTensor] = {}
    if outer is None:
        return found
    copies = getattr(outer, "compute_copies", None)
    if copies is not None and copies.gathered:
        found.update({id(copy_): param for copy_, param in zip(copies.copies, copies.params)})
    for unit in outer.modules():
        if isinstance(unit, FSDPModule):
            found.update(gathered_to_sharded(unit))
    return found


@contextmanager
def _shown_plain(modules: list[nn.Module]) -> Iterator[None]:
    """The modules as they were before sharding, within the block; put back however it ends."""
    undo: list[tuple[nn.Module, type, dict[str, Any], dict[str, list[tuple[Any, Any]]]]] = []
    try:
        for module in modules:
            cls, saved, hooks = type(module), _strategy_attributes_out(module.__dict__), _drop_strategy_hooks(module)
            undo.append((module, cls, saved, hooks))
            module.__class__ = _plain_class(cls)
        yield
    finally:
        for module, cls, saved, hooks in reversed(undo):
            module.__class__ = cls
            if "forward" in saved or _COPIER in saved:
                module.__dict__.pop("forward", None)
            module.__dict__.update(saved)
            for name, items in hooks.items():
                held = module.__dict__[name]
                held.clear()
                held.update(items)


def _strategy_attributes_out(state: dict[str, Any]) -> dict[str, Any]:
    """Take the strategy's attributes out of a module's ``__dict__`` and give back what it replaced (the forward
    before sharding, tensor parallelism's head counts, no device mesh); returns what to put back."""
    copier = state.get(_COPIER)
    split = state.get(SPLIT_ATTRIBUTES, {})  # per-rank head counts of tensor parallelism: the model's own
    saved = {key: state.pop(key) for key in [k for k in state if k.startswith(_STRATEGY_PREFIXES)]}
    for attribute, value in split.items():
        saved[attribute], state[attribute] = state[attribute], value
    if isinstance(copier, _PlainCopier):
        saved.update({key: state.pop(key) for key in (_COPIER, _REDUCER, "forward") if key in state})
        if copier.forward is not _ABSENT:
            state["forward"] = copier.forward
    if "_device_mesh" in state:  # LightningModule.device_mesh: None under DDP
        saved["_device_mesh"], state["_device_mesh"] = state["_device_mesh"], None
    return saved


def _drop_strategy_hooks(module: nn.Module) -> dict[str, list[tuple[Any, Any]]]:
    """Take the strategy's hooks out of ``module``'s hook dicts; returns each changed dict's items as they were."""
    before: dict[str, list[tuple[Any, Any]]] = {}
    dropped: set[int] = set()
    dicts = hook_dicts(module)
    for name, held in dicts.items():
        ours = [key for key, hook in held.items() if callable(hook) and _strategy_code(hook)]
        if ours:
            before[name] = list(held.items())
            dropped.update(ours)
            for key in ours:
                del held[key]
    for name, held in dicts.items():  # the per-id flags of the dropped hooks (with_kwargs, always_call)
        flags = [key for key, hook in held.items() if key in dropped and not callable(hook)]
        if flags:
            before.setdefault(name, list(held.items()))
            for key in flags:
                del held[key]
    return before


def _strategy_code(hook: Any) -> bool:
    function = getattr(hook, "hook", hook)  # torch's _WrappedHook (load_state_dict pre-hooks)
    while isinstance(function, functools.partial):
        function = function.func
    function = getattr(function, "__func__", function)  # a bound method
    return str(getattr(function, "__module__", "") or "").startswith(_STRATEGY_CODE)


def _plain_class(cls: type) -> type:
    """``cls`` without FSDP2's unit class (``FSDP<cls>``) and the fp32 norms' class around it."""
    while True:
        if FSDPModule in cls.__bases__:
            cls = next(base for base in cls.__bases__ if base is not FSDPModule)
            continue
        plain = plain_norm_class(cls)
        if plain is cls:
            return cls
        cls = plain
