"""The optimizer step on each DTensor parameter's local shard, for optimizers that update element by element.

An elementwise optimizer (SGD, Adam, ...: ``precision/elementwise.py``) updates each element from its own gradient
and state, so the step on local tensors is the DTensor step, bit for bit, without DTensor's dispatch of every foreach
op (host time every step, seconds in the first: ViT-H on CPU ~8.7 s). Groups laid out flat on one rank
(``precision/flat_step.py``) step as one tensor each instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import dtensor_like, dtensor_local, same_placements
from lightning_vitscale.precision import flat_step
from lightning_vitscale.precision.elementwise import is_elementwise, steps_locally

# (local tensor, its DTensor parameter, the state swapped in for it or None, the ids of that state's values)
_Swapped = list[tuple[torch.Tensor, DTensor, dict[str, Any] | None, tuple[int, ...]]]


@contextmanager
def on_local_shards(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """Within the block, ``optimizer`` holds its DTensor parameters', gradients' and state's local tensors (updates
    land in place); yields whether it does (not outside ``ELEMENTWISE``, differentiable, or a gradient placed
    otherwise). State the step creates is wrapped as DTensors placed as the parameter; all is put back on raise."""
    swapped = _swap_in(optimizer) if steps_locally(optimizer) else None
    if swapped is None:
        yield False
        return
    try:
        yield True
    finally:
        _swap_back(optimizer, *swapped)


@contextmanager
def lbfgs_on_whole_locals(
    optimizer: torch.optim.LBFGS,
) -> Iterator[Callable[[Callable[[], Any]], Callable[[], Any]]]:
    """Within the block, LBFGS (one rank: each local tensor a whole parameter) holds its parameters' local tensors,
    and the closure it is given (yielded: wrap it) runs with the parameters back (its ``zero_grad`` clears theirs)
    and hands each evaluation's gradients to the local tensors. LBFGS treats all its
    parameters as one flat vector (``p.grad.view(-1)``, ``torch.cat``), which DTensor cannot reshape; and it calls
    the closure again inside its step, which makes new gradients on the DTensors. Its state (flat tensors under its
    first parameter) moves with that parameter."""
    params = optimizer.param_groups[0]["params"]  # LBFGS's own ``_params`` is this list: swapped in place
    originals = list(params)
    local = [dtensor_local(p) if isinstance(p, DTensor) else p for p in originals]
    pairs = [(mine, p) for mine, p in zip(local, originals) if mine is not p]

    def refreshing(closure: Callable[[], Any]) -> Callable[[], Any]:
        def evaluate() -> Any:
            params[:] = originals  # the closure's `optimizer.zero_grad()` clears the parameters' gradients
            try:
                result = closure()
            finally:
                params[:] = local
            for mine, param in pairs:
                mine.grad = None if param.grad is None else dtensor_local(param.grad)
            return result
        return evaluate

    state, key = optimizer.state, originals[0] if originals else None
    params[:] = local
    if key is not None and key in state:
        state[local[0]] = state.pop(key)
    try:
        yield refreshing
    finally:
        params[:] = originals
        if key is not None and local[0] in state:
            state[key] = state.pop(local[0])
        for mine, _ in pairs:
            mine.grad = None


def init_state_locally(optimizer: torch.optim.Optimizer) -> None:
    """torch DCP's ``_init_optim_state`` (one step with zero gradients at lr 0, which DCP's save and load run on a
    fresh optimizer) on the local tensors, for an optimizer that steps them without a DTensor rule for its own step
    (Adafactor on one rank): DCP's would step the DTensors and fail. Elementwise ones are left to DCP. Not DCP's own
    function inside :func:`on_local_shards`: the local tensors do not require grad, so it gives them no gradient."""
    if optimizer.state or is_elementwise(optimizer) or not steps_locally(optimizer):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return  # as DCP: a stateless optimizer with gradients is left alone
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    rates = [group["lr"] for group in optimizer.param_groups if "lr" in group]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    with on_local_shards(optimizer):
        optimizer.step()
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = rates.pop(0)
    optimizer.zero_grad(set_to_none=True)


def _swap_in(optimizer: torch.optim.Optimizer) -> tuple[list[list[Any]], _Swapped, dict[int, Any]] | None:
    groups, state = optimizer.param_groups, optimizer.state
    if any(group.get("differentiable") for group in groups):
        return None  # a differentiable step needs the DTensor graph
    originals = [group["params"] for group in groups]
    flat = flat_step.enter(optimizer)  # these groups step their flat masters
    local_groups = [[flat[i].masters] if i in flat else [dtensor_local(p) for p in params]
                    for i, params in enumerate(originals)]
    pairs = [(local, p) for i, (params, locals_) in enumerate(zip(originals, local_groups)) if i not in flat
             for local, p in zip(locals_, params) if local is not p]
    grads = [param.grad for _, param in pairs]
    if (not pairs and not flat) or any(g is not None and not same_placements(g, p) for g, (_, p) in zip(grads, pairs)):
        flat_step.leave(optimizer, flat, stepped=False)  # the optimizer steps the DTensors themselves
        return None
    for group, params in zip(groups, local_groups):
        group["params"] = params
    swapped: _Swapped = []
    for (local, param), grad in zip(pairs, grads):
        local.grad = None if grad is None else dtensor_local(grad)
        before = state.get(param)  # one lookup, no defaultdict entry
        if before is None:
            swapped.append((local, param, None, ()))
            continue
        made = state[local] = {k: dtensor_local(v) if isinstance(v, DTensor) else v for k, v in before.items()}
        swapped.append((local, param, made, tuple(map(id, made.values()))))
    return originals, swapped, flat


def _swap_back(optimizer: torch.optim.Optimizer, originals: list[list[Any]], swapped: _Swapped,
               flat: dict[int, Any]) -> None:
    for group, params in zip(optimizer.param_groups, originals):
        group["params"] = params
    flat_step.leave(optimizer, flat)
    state = optimizer.state
    for local, param, made, ids in swapped:
        local.grad = None
        after = state.pop(local, None)
        if after is None or (made is not None and after is made and tuple(map(id, made.values())) == ids):
            continue  # updated in place (every step of Adam's after its first): the DTensors hold it already
        state[param] = _as_dtensors(after, state.get(param, {}), param)


def _as_dtensors(after: dict[str, Any], before: dict[str, Any], param: DTensor) -> dict[str, Any]:
    """The step's state for ``param``'s local tensor, back under ``param``: the DTensors it had (updated in place),
    new shard-shaped tensors placed as ``param``, the rest (step counters) as they are."""
    merged: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(old, DTensor) and dtensor_local(old) is value:
            merged[key] = old
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == dtensor_local(param).shape:
            same_layout = value.dtype == param.dtype and value.stride() == dtensor_local(param).stride()
            merged[key] = dtensor_like(value, param) if same_layout else DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            merged[key] = value
    return merged
