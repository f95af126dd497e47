"""Small helpers several concerns share (option texts, byte counts and their text, wrapper prefixes, host memory),
in one home so their rules (FSDP's padding, wrappers' key prefixes) cannot drift apart. Imports only ``_compat``."""

from __future__ import annotations

import copy
import functools
import math
import os
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import nn

from lightning_vitscale._compat import WRAPPER_PREFIXES, dtensor_local

GIB = 2**30
MIB = 2**20
T = TypeVar("T")


class _AutocastFloor(threading.local):
    """This thread's autocast regions that are the strategy's own (``precision/step_autocast.py``): a user's
    ``torch.autocast(..., enabled=False)`` is one more than ``level``. ``device``: the step's autocast device while a
    step runs under it; ``turned_off``: per layer forward running, the floor it replaced (``None``: it changed
    nothing)."""

    def __init__(self) -> None:
        self.level = 0
        self.device: str | None = None
        self.turned_off: list[int | None] = []


AUTOCAST_FLOOR = _AutocastFloor()


def documented(default: T, doc: str) -> T:
    """A settings field documented once: ``doc`` is the option's text (options.py renders it)."""
    return cast(T, field(default=default, metadata={"doc": doc}))


def self_and_ancestors(
    model: nn.Module, owners: set[int], descend: Callable[[nn.Module], bool] = lambda _: True
) -> list[nn.Module]:
    """The modules of ``model`` whose sub-tree holds one of ``owners`` (ids), children before parents: where a call
    reaching an owner can start. ``descend``: which children the walk enters."""
    selected: list[nn.Module] = []

    def visit(module: nn.Module) -> bool:
        below = [visit(child) for child in module.children() if descend(child)]
        holds = id(module) in owners or any(below)
        if holds:
            selected.append(module)
        return holds

    visit(model)
    return selected


def parents(model: nn.Module) -> dict[int, nn.Module]:
    """id of each sub-module of ``model`` -> the module holding it (the last in ``modules()`` order, for one registered
    in two places)."""
    return {id(child): parent for parent in model.modules() for child in parent.children()}


def derived_attributes(model: nn.Module) -> list[torch.Tensor]:
    """Tensors held as plain attributes of ``model``'s modules that autograd computed from parameters (the old
    hook-based ``torch.nn.utils.weight_norm`` keeps its layer's ``weight`` so, recomputed by a pre-hook each forward):
    ``copy.deepcopy`` refuses them ("Only Tensors created explicitly by the user (graph leaves) support the deepcopy
    protocol"), so a copy the strategy makes for itself gives each a stand-in in its memo."""
    attributes = (value for module in model.modules() for value in vars(module).values())
    return [value for value in attributes if isinstance(value, torch.Tensor) and value.grad_fn is not None]


def private_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)`` for a copy the strategy runs by itself (the planner's twin, the tensor plan's
    proof), its hooks and function attributes rebound to the copy. ``deepcopy`` shares functions: a feature hook
    ``layer.register_forward_hook(lambda m, i, out: self.seen.update(f0=out))`` run by the copy wrote into the original
    module's ``seen`` and the copy's forward read its own, empty one (``KeyError``): the planner could not run the step
    and fell back to every block checkpointed, and fake tensors were left in the user's module. A function whose
    closure holds an object the copy copied (the module, its dict, a parameter's stand-in) is rebuilt with the copies;
    bound methods and ``functools.partial`` s are rebound by ``deepcopy`` itself."""
    twin = copy.deepcopy(module, memo)
    for copied in twin.modules():
        for name, value in list(vars(copied).items()):
            if isinstance(value, dict) and name.endswith("hooks"):  # _forward_hooks, _forward_pre_hooks, ...
                value.update({key: _rebound(hook, memo) for key, hook in value.items()})
            elif isinstance(value, (types.FunctionType, functools.partial)):
                vars(copied)[name] = _rebound(value, memo)
    return twin


def _rebound(function: Any, memo: dict[int, Any], depth: int = 0) -> Any:
    """``function`` with each closure cell holding an object of ``memo`` (by ``id``) holding its copy instead; a
    function in a cell (a decorator's wrapped hook) rebound the same way, a few levels deep."""
    if isinstance(function, functools.partial):
        inner = _rebound(function.func, memo, depth)
        return function if inner is function.func else functools.partial(inner, *function.args, **function.keywords)
    if not isinstance(function, types.FunctionType) or not function.__closure__ or depth > 4:
        return function
    cells = []
    for cell in function.__closure__:
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not yet filled
            cells.append(cell)
            continue
        copied = memo.get(id(contents), contents) if id(contents) != id(memo) else contents
        copied = _rebound(copied, memo, depth + 1) if copied is contents else copied
        cells.append(cell if copied is contents else types.CellType(copied))
    if all(new is old for new, old in zip(cells, function.__closure__, strict=True)):
        return function
    rebound = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                                 tuple(cells))
    rebound.__kwdefaults__, rebound.__qualname__ = function.__kwdefaults__, function.__qualname__
    rebound.__dict__.update(function.__dict__)
    return rebound


def trainer_of(module: Any) -> Any:
    """The Trainer ``module`` is attached to (``LightningModule.trainer``), or ``None``: none given, not a
    LightningModule, or not attached (the property raises then)."""
    try:
        return module.trainer if module is not None else None
    except (AttributeError, RuntimeError):
        return None


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank actually stores for ``tensors`` (a DTensor counts its local shard only)."""
    return sum(dtensor_local(t).numel() * t.element_size() for t in tensors)


def full_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the same tensors take unsharded (what one DDP rank holds)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def shard_rows(rows: int, shard_group: int) -> int:
    """Rows of dim 0 each rank holds: FSDP2 pads dim 0 to a multiple of the shard-group size (``torch.chunk``)."""
    return math.ceil(rows / shard_group)


def shard_numel(shapes: Iterable[Sequence[int]], shard_group: int) -> int:
    """Elements the fullest rank of a shard group holds (the padded total is ``shard_group`` times this)."""
    return sum(shard_rows(s[0] if len(s) else 1, shard_group) * math.prod(s[1:]) for s in shapes)


def mib(n: float, digits: int = 1) -> str:
    return f"{n / MIB:,.{digits}f} MiB"


def abbreviated(names: Sequence[str], keep: int = 3) -> str:
    """The first ``keep`` of ``names`` and how many more: the summary's and the errors' lists of modules."""
    return ", ".join(names[:keep]) + (f", ... +{len(names) - keep}" if len(names) > keep else "")


def human_bytes(n: float) -> str:
    """GiB from one GiB up, MiB below: the unit people read memory budgets in."""
    return f"{n / GIB:,.2f} GiB" if n >= GIB else mib(n)


def strip_wrapper_prefixes(name: str) -> str:
    """A parameter's name as the plain module's state dict spells it (and so a DDP checkpoint)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def available_host_bytes() -> int | None:
    """``MemAvailable`` of this host (Linux), or ``None`` where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def register_gradient_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """``param.register_hook(hook)``, a frozen parameter's too: torch refuses a hook on a tensor that does not require
    grad, so a frozen one is hooked while requiring grad, then frozen again; unfrozen later (``BackboneFinetuning``),
    the hook runs."""
    frozen = not param.requires_grad
    if frozen:
        param.requires_grad_(True)
    try:
        torch.Tensor.register_hook(param, hook)  # torch's own: a user's is refused on sharded ones after setup
    finally:
        if frozen:
            param.requires_grad_(False)
