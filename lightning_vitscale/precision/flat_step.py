"""One rank: each param group of an elementwise optimizer stepped as one flat tensor (apex's flat-master step).

On one rank (``sharding/compute_copies.py``) most of the host time a step spent beyond plain AMP's was per tensor:
the optimizer's kernels over ~390 tensors (AdamW on CPU: 12.7-13.7 ms a ViT-H-deep step; the same elements as one
tensor: 3.6-3.8 ms), the swap to local shards and back, the non-finite check (benchmarks/RESULTS.md, issue 47).

At optimizer setup, :func:`lay_out` moves each eligible group's fp32 masters into one buffer; each parameter's local
tensor becomes a view of it. The hand-over casts the gradients into views of one fresh buffer laid out alike
(:meth:`FlatGroup.gradient_views`). The step then gives the optimizer the flat buffers. The state it makes is shown
per parameter as DTensor views of its flat tensors (checkpoints, ``optimizer.state`` and resumes see what they saw).
An elementwise update of a flat tensor is the per-tensor update of each of its views, element for element.

A step that does not match the layout steps per tensor, as before:
- a gradient missing or replaced;
- a parameter's local tensor rebound since;
- state whose counters differ between parameters.
State replaced from outside (a resume, ``Adagrad``'s constructor) is copied into flat buffers first, when its
elementwise values have the parameters' shapes and its counters agree, so a resumed run steps flat again.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_vitscale._compat import dtensor_like, dtensor_local, foreach_copy_, rebind_local, shaped_views
from lightning_vitscale.precision.elementwise import is_elementwise

_State = dict[str, Any]

# Per optimizer, per param group (by index): its flat layout, or None where the group steps per tensor.
_LAYOUTS: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[FlatGroup | None]] = weakref.WeakKeyDictionary()
# Per laid-out optimizer, its step post-hook (_stepped): one, however often it is laid out.
_HOOKS: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = weakref.WeakKeyDictionary()


class FlatGroup:
    """One param group's fp32 masters as views of one buffer, and the optimizer state made on it."""

    def __init__(self, params: list[DTensor]) -> None:
        self.params = params
        locals_ = [dtensor_local(p) for p in params]
        self._like = locals_  # their shapes, until the views below stand in
        self.shapes = [t.shape for t in locals_]
        self.sizes = [t.numel() for t in locals_]
        self.offsets = list(accumulate(self.sizes[:-1], initial=0))
        self.masters = torch.empty(sum(self.sizes), dtype=locals_[0].dtype, device=locals_[0].device)
        self.views = self._views(self.masters)
        with torch.no_grad():
            foreach_copy_(self.views, locals_)
        for param, view in zip(params, self.views):
            rebind_local(param, view)
        self._like = self.views  # the tensors before are freed: no second copy of the masters
        self._state: _State | None = None  # the flat state, once a step made it or it was copied in
        self._state_values: list[Any] = []
        self._counters: dict[str, torch.Tensor] = {}  # per counter key, one element per parameter (their views)
        self._stale = False  # a step since ran per tensor: the per-parameter state is the truth
        self._inside = False  # between enter and leave
        self._shown: list[_State] = []  # the per-parameter dicts showing it in `optimizer.state`
        self._shown_values: list[Any] = []

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return shaped_views(flat, self._like)

    def gradient_views(self) -> list[torch.Tensor]:
        """Views, shaped as the parameters, of a fresh buffer laid out as the masters: the hand-over casts the
        gradients into them. The buffer lives as long as any of them (``zero_grad`` frees it)."""
        return self._views(torch.empty_like(self.masters))

    def enter(self, params: list[Any], state: dict[Any, _State]) -> bool:
        """Whether the group (``params``) steps on the flat tensors this time; if so, until :meth:`leave`, the flat
        masters hold their gradient and ``state`` their state: the caller gives the group ``[self.masters]``."""
        gradient = self._flat_gradient(params) if self._laid_out(params) else None
        if gradient is None or not self._state_ready(state):
            self._stale = True  # this step runs per tensor, on the per-parameter views
            return False
        self.masters.grad = gradient
        if self._state is not None:
            state[self.masters] = self._state
        self._inside = True
        return True

    def leave(self, state: dict[Any, _State], stepped: bool = True) -> None:
        """After the step (the group holds its parameters again): the state the step made, shown per parameter.
        ``stepped=False``: no flat step ran; the parameters step some other way."""
        self.masters.grad = None
        self._inside = False
        after = state.pop(self.masters, None)
        if not stepped:
            self._stale = True
            return
        if not after:  # no state (SGD without momentum), or the step was skipped before making any
            return
        if after is not self._state or not _same_objects(list(after.values()), self._state_values):
            self._show(after, state)  # made or replaced by this step (every step's state after the first: in place)
            return
        for counters in self._counters.values():  # one op each, not one per parameter
            counters[1:].fill_(counters[0])

    def _laid_out(self, params: list[Any]) -> bool:
        """The group's parameters are still the laid-out ones, each still holding its view of the masters (its
        local tensor not rebound since, as a later layout or FSDP2 would)."""
        return (len(params) == len(self.params) and all(map(operator.is_, params, self.params))
                and all(map(operator.is_, (dtensor_local(p) for p in params), self.views)))

    def _flat_gradient(self, params: list[Any]) -> torch.Tensor | None:
        """The buffer behind every parameter's gradient, if they are still the hand-over's views of one."""
        grads = [p.grad for p in params]
        if not all(isinstance(g, DTensor) for g in grads):
            return None
        locals_ = [dtensor_local(g) for g in grads]
        buffer = locals_[0]._base
        if buffer is None or buffer.shape != self.masters.shape or buffer.dtype != self.masters.dtype:
            return None
        if not all(t._base is buffer and t.storage_offset() == o for t, o in zip(locals_, self.offsets)):
            return None
        return buffer

    def _state_ready(self, state: dict[Any, _State]) -> bool:
        shown = [state.get(p) for p in self.params]  # `get`: no defaultdict entries
        if self._state is not None and not self._stale and all(map(operator.is_, shown, self._shown)):
            if _same_objects([v for d in self._shown for v in d.values()], self._shown_values):
                return True
        if self._state is None and not any(shown):
            return True  # no state yet: the first step makes it on the flat tensors
        return self._copy_in(shown, state)

    def _copy_in(self, shown: list[_State | None], state: dict[Any, _State]) -> bool:
        """Per-parameter state made elsewhere (a resume, a constructor) copied into flat tensors; ``False`` where it
        has no flat form (a parameter without state, keys that differ, counters that disagree)."""
        dicts = [d for d in shown if d]
        if len(dicts) != len(shown):
            return False
        keys = list(dicts[0])
        if any(list(d) != keys for d in dicts):
            return False
        flat: _State = {}
        for key in keys:
            values = [d[key] for d in dicts]
            merged = self._merged(values)
            if merged is None:
                return False
            flat[key] = merged
        self._show(flat, state)
        return True

    @torch.no_grad()
    def _merged(self, values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:  # elementwise: one view per parameter
            locals_ = [dtensor_local(v) for v in values if isinstance(v, torch.Tensor)]
            head = locals_[0]
            if len(locals_) != len(values) or any(t.shape != s or t.dtype != head.dtype or t.device != head.device
                                                  for t, s in zip(locals_, self.shapes)):
                return None
            merged = torch.empty(sum(self.sizes), dtype=head.dtype, device=head.device)
            foreach_copy_(self._views(merged), locals_)
            return merged
        if isinstance(first, torch.Tensor):  # a counter (Adam's `step`): one for all, where all agree
            if not all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == first.dtype
                       and v.device == first.device for v in values):
                return None
            same = bool(torch.equal(torch.stack(values), first.expand(len(values))))
            return first.clone() if same else None
        return first if all(v == first for v in values) else None

    def _show(self, flat: _State, state: dict[Any, _State]) -> None:
        """``flat`` becomes the group's state; each parameter's entry in ``state`` holds views of it. A counter
        (Adam's ``step``) is one element per parameter of one tensor; the flat step counts on the first element and
        the rest are filled from it after each flat step: a parameter stepped per tensor (a fallback) counts its own
        steps, as it would have without the flat step."""
        count = len(self.params)
        self._counters = {key: torch.empty(count, dtype=value.dtype, device=value.device).fill_(value)
                          for key, value in flat.items() if isinstance(value, torch.Tensor) and value.dim() == 0}
        for key, counters in self._counters.items():
            flat[key] = counters[0]  # the flat step counts on the first parameter's counter, then fills the rest
        per_key: dict[str, Any] = {}
        for key, value in flat.items():
            if _is_flat(value, self.masters):
                per_key[key] = [_placed_like(view, p) for view, p in zip(self._views(value), self.params)]
            elif key in self._counters:
                per_key[key] = list(self._counters[key].unbind())
            else:
                per_key[key] = [value] * count
        shown = [dict(zip(per_key, values)) for values in zip(*per_key.values())] if per_key else []
        for param, entry in zip(self.params, shown):
            state[param] = entry
        self._state, self._state_values, self._stale = flat, list(flat.values()), False
        self._shown, self._shown_values = shown, [v for d in shown for v in d.values()]


def _is_flat(value: Any, masters: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == masters.shape


def _placed_like(local: torch.Tensor, param: DTensor) -> DTensor:
    if local.dtype == param.dtype:
        return dtensor_like(local, param)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _same_objects(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def lay_out(optimizers: Sequence[torch.optim.Optimizer], eligible: Sequence[torch.Tensor]) -> list[FlatGroup]:
    """Each param group of an elementwise optimizer whose parameters are all in ``eligible`` (one rank's fp32
    DTensor masters, contiguous, of one dtype and device; no parameter in two groups) laid out flat. Returns the
    groups laid out. Before any step: it moves the masters."""
    allowed = {id(p) for p in eligible}
    taken: set[int] = set()
    made: list[FlatGroup] = []
    for optimizer in optimizers:
        layout: list[FlatGroup | None] = []
        for group in optimizer.param_groups:
            params = group["params"]
            ids = [id(p) for p in params]
            fits = (is_elementwise(optimizer) and not group.get("differentiable") and len(params) > 1
                    and len(set(ids)) == len(ids) and all(i in allowed and i not in taken for i in ids)
                    and _one_kind(params))
            flat = FlatGroup(list(params)) if fits else None
            if flat is not None:
                taken.update(ids)
                made.append(flat)
            layout.append(flat)
        _LAYOUTS[optimizer] = layout
        if optimizer not in _HOOKS and any(layout):
            _HOOKS[optimizer] = optimizer.register_step_post_hook(_stepped)
    return made


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After every ``optimizer.step()``: a flat group not stepping flat in it (a raw ``optimizer.step()`` that
    bypassed Lightning's, on the per-parameter views) takes its per-parameter state as the truth at its next flat
    step, whose counters may no longer agree."""
    for flat in _LAYOUTS.get(optimizer) or ():
        if flat is not None and not flat._inside:
            flat._stale = True


def _one_kind(params: list[Any]) -> bool:
    locals_ = [dtensor_local(p) for p in params]
    head = locals_[0]
    return all(isinstance(p, DTensor) for p in params) and all(
        t.is_contiguous() and t.dtype == head.dtype and t.device == head.device and t.is_floating_point()
        for t in locals_
    )


def enter(optimizer: torch.optim.Optimizer) -> dict[int, FlatGroup]:
    """The optimizer's groups (by index) that step flat this time: the caller gives each its ``[masters]``."""
    layout = _LAYOUTS.get(optimizer)
    entered: dict[int, FlatGroup] = {}
    if not layout:
        return entered
    state = optimizer.state
    try:
        for index, (flat, group) in enumerate(zip(layout, optimizer.param_groups)):
            if flat is not None and flat.enter(group["params"], state):
                entered[index] = flat
    except BaseException:
        leave(optimizer, entered, stepped=False)
        raise
    return entered


def leave(optimizer: torch.optim.Optimizer, entered: dict[int, FlatGroup], stepped: bool = True) -> None:
    """After the step, the groups holding their parameters again (``stepped=False``: they step otherwise)."""
    for flat in entered.values():
        flat.leave(optimizer.state, stepped)


def describe(groups: list[FlatGroup]) -> list[str]:
    """One line for the setup summary's notes."""
    if not groups:
        return []
    tensors = sum(len(g.params) for g in groups)
    return [f"optimizer step: {len(groups)} param group(s) stepped as one flat tensor each ({tensors} parameters)"]
