"""What a run of a model called: the modules whose ``forward`` ran, the first arguments of chosen ones, the module
running when it raised, and the first outputs per module. Read from forward hooks while the run lasts (torch's
global module hooks for every module, the chosen modules' own hooks for keyword arguments); nothing stays behind."""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_vitscale._compat import autocast_turned_off, current_backward_id, tree_leaves, tree_map
from lightning_vitscale._utils import AUTOCAST_FLOOR


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as recorded: its shape and dtype (the values of a fake run mean nothing), and whether the
    step's autograd flows through it (the planner replays a block's backward as the step runs it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False


@dataclass
class Calls:
    """What one run called: ``called`` modules (qualified names) and how many times each ran (``counts``: a block
    whose weights serve every layer runs once per layer), each watched module's first ``inputs`` (tensors as
    :class:`TensorSpec`), the modules still ``running`` (outermost first: where a run that raised was), with
    ``keep_outputs`` each module's first floating ``outputs``, and the ``error`` it raised (``"Type: message"``)."""

    counts: Counter[str] = field(default_factory=Counter)
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    fed: dict[str, str] = field(default_factory=dict)
    """Module -> the module whose output its first call took as its first tensor argument: a stack's blocks feed
    each other, an MoE layer's experts (each handed its own tokens) do not (``blocks._side_by_side``)."""
    order: list[str] = field(default_factory=list)
    """The blocks a measured step called, in the order it called them, a call each (set by the planner, whose hooks
    see the step's calls alone): the order the units follow (``blocks.find_holding_units``) and which blocks run as
    one stretch (``unit_runs.sharing_keys``)."""
    full_precision: set[str] = field(default_factory=set)
    """Modules the step ran inside its own ``torch.autocast(..., enabled=False)``: fp32 under DDP's AMP, so kept in
    fp32 under O2 too (``PrecisionPolicy.keeping_fp32``)."""
    kept_fp32: dict[str, str] = field(default_factory=dict)
    """Modules whose own code raised with their weights in the compute dtype, with torch's error: kept in fp32 as
    DDP's AMP keeps every weight (``memory/low_precision_failures.py``)."""
    without_gradient: tuple[str, ...] | None = None
    """Trainable parameters the measured step's loss does not reach (``None``: not known): several ranks reduce a zero
    gradient for one no rank used, where DDP's ``find_unused_parameters=True`` leaves it none (setup's note)."""
    error: str = ""

    @property
    def called(self) -> set[str]:
        return set(self.counts)

    def clear(self) -> None:
        """Forget an earlier run (a measurement retried another way records afresh)."""
        self.__dict__.update(Calls().__dict__)

    def agree(self, broadcast: Callable[[Any], Any]) -> None:
        """Rank 0's record of what ran and what fed what, on every rank (``broadcast``: rank 0's value everywhere):
        a step that runs differently by rank (LayerDrop drawn per rank) must not give the ranks different blocks,
        and so different units whose collectives cannot pair."""
        counts, fed, error, running, full, order, kept, without = broadcast((
            self.counts, self.fed, self.error, self.running, self.full_precision, self.order, self.kept_fp32,
            self.without_gradient))
        self.counts, self.fed, self.error, self.running = Counter(counts), dict(fed), error, list(running)
        self.full_precision, self.order, self.kept_fp32 = set(full), list(order), dict(kept)
        self.without_gradient = without

    @property
    def in_fp32(self) -> set[str]:
        """Every module the step needs in fp32 under O2: its own fp32 regions' and those that raised in bf16."""
        return self.full_precision | set(self.kept_fp32)

    @property
    def where(self) -> str:
        """The innermost module running when the run raised (``""``: none, or it did not raise)."""
        return self.running[-1] if self.error and self.running else ""


@contextlib.contextmanager
def recording(
    model: nn.Module, calls: Calls, watch: Sequence[tuple[str, nn.Module]] = (), keep_outputs: bool = False
) -> Iterator[Calls]:
    """Record into ``calls`` what ``model`` calls while the body runs; ``watch``: ``(name, module)`` pairs whose first
    arguments are kept. An exception from the body is recorded in ``calls.error`` and raised on."""
    recorder = _Recorder(model, calls, keep_outputs)

    def keep_inputs(name: str, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.inputs.setdefault(name, (tree_map(_spec, args), tree_map(_spec, kwargs)))

    handles = [register_module_forward_pre_hook(recorder.enter), register_module_forward_hook(recorder.leave)]
    handles += [m.register_forward_pre_hook(partial(keep_inputs, n), with_kwargs=True) for n, m in watch]
    try:
        yield calls
    except Exception as error:
        calls.error = f"{type(error).__name__}: {error}"
        raise
    finally:
        for handle in handles:
            handle.remove()


class _Recorder:
    """The global hooks' side of :func:`recording`: counts, the modules running, first outputs, who fed whom."""

    def __init__(self, model: nn.Module, calls: Calls, keep_outputs: bool) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.calls, self.keep_outputs = calls, keep_outputs
        self.produced = _Producers()

    def enter(self, module: nn.Module, args: Any) -> None:
        name, calls = self.names.get(id(module)), self.calls
        if name is not None:
            if name not in calls.counts:
                self.produced.note_input(calls.fed, name, args)
            calls.counts[name] += 1
            calls.running.append(name)
            first = _first_floating(args)
            # Not in backward: checkpointing's recompute restores the forward's autocast state in a region of its own.
            if first is not None and current_backward_id() == -1 and autocast_turned_off(first.device.type,
                                                                                         AUTOCAST_FLOOR.level):
                calls.full_precision.add(name)

    def leave(self, module: nn.Module, _: Any, out: Any) -> None:
        name, calls = self.names.get(id(module)), self.calls
        if name is None or not calls.running or calls.running[-1] != name:
            return
        calls.running.pop()
        first = _first_floating(out)
        if first is None:
            return
        if self.keep_outputs and name not in calls.outputs:
            calls.outputs[name] = first.detach().clone()
        if calls.counts[name] == 1:
            self.produced.returned(name, first)


class _Producers:
    """Which module's first call returned each tensor still alive: a weak reference compared by identity, so a freed
    tensor's id taken by a new tensor names no producer."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[str, weakref.ref]] = {}

    def returned(self, name: str, tensor: torch.Tensor) -> None:
        self._by_id[id(tensor)] = (name, weakref.ref(tensor))

    def note_input(self, fed: dict[str, str], name: str, args: Any) -> None:
        """``fed[name]``: the module that returned ``name``'s first floating argument, where one did."""
        tensor = _first_floating(args)
        found = self._by_id.get(id(tensor)) if tensor is not None else None
        if found is not None and found[1]() is tensor:
            fed[name] = found[0]


def _first_floating(tree: Any) -> torch.Tensor | None:
    return next((v for v in tree_leaves(tree) if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def _spec(value: Any) -> Any:
    return TensorSpec(tuple(int(s) for s in value.shape), value.dtype) if isinstance(value, torch.Tensor) else value
