"""Record the init a model's own code ran on meta tensors, and replay it on each rank's shards.

A model built on the meta device has shapes but no values: ``nn.init`` calls, ``reset_parameters()`` and
``self.apply(init_fn)`` run on it as no-ops. :class:`InitRecorder` watches construction at the ATen level
(a ``TorchDispatchMode``), where every ``nn.init`` function has already been lowered to elementwise in-place ops
with its bounds computed from the *global* shape (``kaiming_uniform_`` arrives as ``uniform_(-b, b)``), and
keeps, per storage, the ordered ops that set its values: a :class:`Recipe`. torch's ``trunc_normal_`` returns
early on meta tensors, so its helper is wrapped while recording. Elementwise ops give the same distribution on
any slice, so a recipe replays on a rank's local shard; anything else (``orthogonal_``, partial writes, values
computed from other tensors) marks the tensor as not reproducible, and the caller names it in a warning.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import TRUNC_NORMAL_IMPL, TorchDispatchMode, storage_id

# In-place ops that set every element from scalars alone: they replay on any slice of the tensor.
_OVERWRITES = frozenset({"uniform_", "normal_", "fill_", "zero_", "random_", "bernoulli_", "exponential_",
                         "log_normal_", "cauchy_", "geometric_", "trunc_normal_"})
_ELEMENTWISE = _OVERWRITES | frozenset({"mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_",
                                        "erfinv_", "abs_", "neg_", "sqrt_", "exp_", "log_", "pow_", "tanh_",
                                        "sigmoid_", "round_", "floor_", "ceil_", "reciprocal_"})
# Out-of-place elementwise ops whose result inherits the input's recipe (then the in-place twin).
_DERIVED = {"mul": "mul_", "add": "add_", "sub": "sub_", "div": "div_", "neg": "neg_", "clamp": "clamp_",
            "abs": "abs_", "exp": "exp_", "sqrt": "sqrt_", "pow": "pow_", "erfinv": "erfinv_"}
_FACTORIES: dict[str, tuple[Any, ...] | None] = {  # op name -> (in-place op, *its scalar args)
    "empty": None, "empty_like": None, "new_empty": None, "empty_strided": None, "new_empty_strided": None,
    "zeros": ("zero_",), "zeros_like": ("zero_",), "new_zeros": ("zero_",),
    "ones": ("fill_", 1), "ones_like": ("fill_", 1), "new_ones": ("fill_", 1),
    "randn": ("normal_", 0.0, 1.0), "randn_like": ("normal_", 0.0, 1.0),
    "rand": ("uniform_", 0.0, 1.0), "rand_like": ("uniform_", 0.0, 1.0),
}
_COPIES = frozenset({"_to_copy", "clone"})  # a copy inherits the recipe (deepcopy of a meta module clones)
_VALUE_FACTORIES = {"full": 1, "full_like": 1, "new_full": 1}  # op name -> index of the fill value
_NOT_ELEMENTWISE = ("orthogonal_", "sparse_", "dirac_", "eye_")  # nn.init functions that no-op on meta


@dataclass
class Recipe:
    """The ordered ops that gave one tensor its values, or why they cannot be replayed."""

    steps: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    broken: str | None = None

    @property
    def initialised(self) -> bool:
        return bool(self.steps) and self.broken is None

    def add(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.broken is not None:
            return
        if name in _OVERWRITES:
            self.steps.clear()  # an overwrite makes everything before it irrelevant
        self.steps.append((name, args, {k: v for k, v in kwargs.items() if k != "generator"}))

    def copy(self) -> Recipe:
        return Recipe(list(self.steps), self.broken)


def _covers_storage(tensor: torch.Tensor) -> bool:
    whole = tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    return bool(tensor.storage_offset() == 0 and whole)  # bool(): SymBool on symbolic shapes


def _scalars_only(values: Any) -> bool:
    return not any(isinstance(v, torch.Tensor) for v in values)


class InitRecorder(TorchDispatchMode):
    """Records recipes for meta tensors created and initialised while it is active (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.recipes: dict[int, Recipe] = {}
        self._alive: list[torch.Tensor] = []  # keeps storages alive, so no address is reused for another tensor
        self._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        try:
            self._observe(func.overloadpacket.__name__, args, kwargs, out)
        except (RuntimeError, NotImplementedError):  # storage-less tensor kinds: nothing to record
            pass
        return out

    def _track(self, tensor: torch.Tensor, recipe: Recipe) -> None:
        self.recipes[storage_id(tensor)] = recipe
        self._alive.append(tensor)

    def _observe(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        first = args[0] if args else None
        if isinstance(out, torch.Tensor) and out.is_meta and (name in _FACTORIES or name in _VALUE_FACTORIES):
            recipe = Recipe()
            if name in _VALUE_FACTORIES:
                recipe.add("fill_", (args[_VALUE_FACTORIES[name]],), {})
            elif (init := _FACTORIES[name]) is not None:
                recipe.add(init[0], tuple(init[1:]), {})
            self._track(out, recipe)
        elif isinstance(first, torch.Tensor) and first.is_meta and name in _ELEMENTWISE | {"copy_"}:
            self._in_place(name, first, args[1:], kwargs)
        elif name in _DERIVED and isinstance(first, torch.Tensor) and first.is_meta and isinstance(out, torch.Tensor):
            parent = self.recipes.get(storage_id(first))
            if parent is not None and _scalars_only(args[1:]) and _scalars_only(kwargs.values()):
                derived = parent.copy()
                derived.add(_DERIVED[name], tuple(args[1:]), kwargs)
                self._track(out, derived)
        elif name in _COPIES and isinstance(first, torch.Tensor) and first.is_meta and isinstance(out, torch.Tensor):
            if (parent := self.recipes.get(storage_id(first))) is not None:
                self._track(out, parent.copy())

    def _in_place(self, name: str, target: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recipe = self.recipes.setdefault(storage_id(target), Recipe())
        self._alive.append(target)
        if not _covers_storage(target):
            recipe.broken = f"`{name}` wrote only part of the tensor"
        elif name == "copy_":
            source = rest[0]
            parent = self.recipes.get(storage_id(source)) if source.is_meta else None
            if parent is None or not _covers_storage(source):
                recipe.broken = "its values were copied from another tensor"
            else:
                self.recipes[storage_id(target)] = parent.copy()
        elif not (_scalars_only(rest) and _scalars_only(kwargs.values())):
            recipe.broken = f"`{name}` took a tensor argument"
        else:
            recipe.add(name, tuple(rest), kwargs)

    def mark(self, tensor: torch.Tensor, step: tuple[str, tuple[Any, ...], dict[str, Any]] | str) -> None:
        """Record a step (or a reason it cannot be replayed) that torch skips on meta tensors."""
        if not tensor.is_meta:
            return
        recipe = self.recipes.setdefault(storage_id(tensor), Recipe())
        self._alive.append(tensor)
        if isinstance(step, str):
            recipe.broken = step
        elif _covers_storage(tensor):
            recipe.add(*step)
        else:
            recipe.broken = f"`{step[0]}` wrote only part of the tensor"

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run meanwhile are not recorded: the inside of an ``nn.init`` function already recorded whole by
        :meth:`mark` (``trunc_normal_``'s ``uniform_``, ``erfinv_``, ...)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def recipe_of(self, tensor: torch.Tensor) -> Recipe | None:
        return self.recipes.get(storage_id(tensor)) if tensor.is_meta else None


@contextmanager
def recording() -> Iterator[InitRecorder]:
    """Record init recipes; also sees the ``nn.init`` functions that return early on meta tensors."""
    recorder = InitRecorder()
    originals = {name: getattr(nn.init, name) for name in (TRUNC_NORMAL_IMPL, *_NOT_ELEMENTWISE)}

    def trunc_normal(tensor, mean, std, a, b, generator=None):  # type: ignore[no-untyped-def]
        recorder.mark(tensor, ("trunc_normal_", (mean, std, a, b), {}))
        with recorder.paused():
            return originals[TRUNC_NORMAL_IMPL](tensor, mean, std, a, b, generator)

    def refusing(name, tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        recorder.mark(tensor, f"`nn.init.{name}` is not elementwise")
        with recorder.paused():
            return originals[name](tensor, *args, **kwargs)

    patched = {TRUNC_NORMAL_IMPL: trunc_normal, **{name: partial(refusing, name) for name in _NOT_ELEMENTWISE}}
    try:
        for name, fn in patched.items():
            setattr(nn.init, name, fn)
        with recorder:
            yield recorder
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


def tensor_seed(base: int, name: str, shard: int) -> int:
    """A seed per tensor and shard: shards of one tensor draw independent values, replicas identical ones."""
    digest = hashlib.sha256(f"{base}:{name}:{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def replay(local: torch.Tensor, recipe: Recipe, seed: int) -> None:
    torch.manual_seed(seed)
    for name, args, kwargs in recipe.steps:
        if name == "trunc_normal_":
            _trunc_normal_in_place(local, *args)
        else:
            getattr(local, name)(*args, **kwargs)


def _trunc_normal_in_place(tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> None:
    """The truncated normal by its inverse CDF, in place: torch's rejection sampler allocates a mask and two
    more tensors of the shard's size per call, which the allocator keeps as holes between the shards."""
    def cdf(x: float) -> float:
        return (1 + math.erf((x - mean) / (std * math.sqrt(2)))) / 2

    low, high = cdf(a), cdf(b)
    tensor.uniform_(2 * low - 1, 2 * high - 1).erfinv_().mul_(std * math.sqrt(2)).add_(mean).clamp_(min=a, max=b)
