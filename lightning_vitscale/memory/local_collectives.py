"""Collectives a measured step sends, done on the measuring rank alone, as in a world where every rank holds its
data.

The planner runs the user's ``training_step`` at setup on one rank (the others wait for its plan in a broadcast). A
step that talks to the other ranks itself (``self.trainer.strategy.broadcast(seed)`` or ``barrier()``,
``self.all_gather(z)`` for a contrastive loss, DETR's ``torch.distributed.all_reduce(num_boxes)``, a torchmetrics
``compute()``) sent those collectives for real from inside the measurement: a fake tensor made from a constant
carries its value, so gloo sent it, and it met the other ranks' wait for the plan. Measured: "Received data size
doesn't match expected size" and a process killed by gloo (``broadcast``), or a collective that paired with the
plan's and went unnoticed (``barrier``, ``reduce``). Under DDP these steps just work.

Here every c10d op (the ops behind all of ``torch.distributed``'s collectives and Lightning's) and every functional
collective is answered on the rank: a reduction or broadcast leaves its tensors as they are, a gather fills each
rank's slot with this rank's tensor, a reduce-scatter hands out this rank's chunk. Shapes are exactly the real
ones; values are one rank's (read only where the fake tensors carry real values, for a branch). Nothing is sent,
so no rank can be left waiting for a measurement's collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_vitscale._compat import fake_work, op_result_count

Run = Callable[..., Any]  # runs one aten op (the fake mode's dispatch) on its arguments
aten = torch.ops.aten
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def answered_locally(func: Any, args: Sequence[Any], kwargs: dict[str, Any], run: Run) -> Any:
    """The result of collective ``func`` (an op of :data:`COLLECTIVE_NAMESPACES`), answered here: nothing sent."""
    if func.namespace == "c10d":
        handler = _C10D.get(func.overloadpacket.__name__)
        return handler(args, run) if handler else _leave(func, args)
    return _functional(func.overloadpacket.__name__, args, kwargs, run)


def _rank(slots: int) -> int:
    """This rank's slot among ``slots`` (the default group's rank: the planner measures on the world's ranks)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return rank % max(slots, 1)


def _leave(func: Any, args: Sequence[Any]) -> Any:
    """The op's result with its tensors untouched: a reduction or broadcast of one rank's (equal) data, a barrier."""
    count = op_result_count(func)
    if count == 0:
        return None
    if count == 1:
        return fake_work()
    return args[0], fake_work()


def _tile(out: torch.Tensor, value: torch.Tensor, run: Run) -> None:
    """``out`` (``k`` times ``value``'s elements, contiguous, as all-gathered into one tensor) filled with ``value``
    ``k`` times; a layout it cannot view is left as it is (only its shape matters to the measurement)."""
    count = value.numel()
    if count == 0 or out.numel() % count or not out.is_contiguous():
        return
    times = out.numel() // count
    flat = run(aten.view.default, run(aten.clone.default, value, memory_format=torch.contiguous_format), [1, count])
    run(aten.copy_.default, run(aten.view.default, out, [times, count]), run(aten.expand.default, flat, [times, count]))


def _chunk_of(value: torch.Tensor, out: torch.Tensor, run: Run) -> None:
    """``out`` filled with this rank's chunk of ``value`` (a reduce-scatter's input: each rank's chunk in a row)."""
    count = out.numel()
    if count == 0 or value.numel() % count or not out.is_contiguous():
        return
    flat = run(aten.view.default, run(aten.clone.default, value, memory_format=torch.contiguous_format), [-1])
    start = _rank(value.numel() // count) * count
    run(aten.copy_.default, out, run(aten.view.default, run(aten.slice.Tensor, flat, 0, start, start + count),
                                     list(out.shape)))


def _copy(out: torch.Tensor, value: torch.Tensor, run: Run) -> None:
    if out.shape == value.shape:
        run(aten.copy_.default, out, value)


def _gathered(args: Sequence[Any], run: Run) -> None:
    for outputs, value in zip(args[0], args[1]):  # one list of per-rank outputs for each input
        for out in outputs:
            _copy(out, value, run)


def _reduce_scattered(args: Sequence[Any], run: Run) -> None:
    for out, values in zip(args[0], args[1]):  # each rank's input in a list: this rank's is its result
        _copy(out, values[_rank(len(values))], run)


def _exchanged(args: Sequence[Any], run: Run) -> None:
    for out, value in zip(args[0], args[1]):  # an all-to-all of equal parts: this rank's own part stays
        _copy(out, value, run)


def _scattered(args: Sequence[Any], run: Run) -> None:
    for out, values in zip(args[0], args[1]):  # the root's list of per-rank inputs (empty on the others)
        if values:
            _copy(out, values[_rank(len(values))], run)


def _pairs(handle: Callable[[torch.Tensor, torch.Tensor, Run], None]) -> Callable[[Sequence[Any], Run], Any]:
    """A handler applying ``handle`` to each (output, input) pair of a coalesced op's two lists."""
    def handler(args: Sequence[Any], run: Run) -> Any:
        for out, value in zip(args[0], args[1]):
            handle(out, value, run)
        return fake_work()
    return handler


def _then(action: Callable[[Sequence[Any], Run], None], result_first: bool) -> Callable[[Sequence[Any], Run], Any]:
    def handler(args: Sequence[Any], run: Run) -> Any:
        action(args, run)
        return (args[0], fake_work()) if result_first else fake_work()
    return handler


# The ops that write results other than their inputs; every other c10d op leaves its tensors (_leave).
_C10D: dict[str, Callable[[Sequence[Any], Run], Any]] = {
    "allgather_": _then(_gathered, result_first=True),
    "allgather_coalesced_": _then(_gathered, result_first=False),
    "gather_": _then(_gathered, result_first=False),  # outputs only on the root
    "_allgather_base_": _then(lambda args, run: _tile(args[0], args[1], run), result_first=True),
    "allgather_into_tensor_coalesced_": _pairs(_tile),
    "reduce_scatter_": _then(_reduce_scattered, result_first=True),
    "_reduce_scatter_base_": _then(lambda args, run: _chunk_of(args[1], args[0], run), result_first=True),
    "reduce_scatter_tensor_coalesced_": _pairs(lambda out, value, run: _chunk_of(value, out, run)),
    "scatter_": _then(_scattered, result_first=True),
    "alltoall_": _then(_exchanged, result_first=True),
    "alltoall_base_": _then(lambda args, run: _copy(args[0], args[1], run), result_first=False),
}


def _functional(name: str, args: Sequence[Any], kwargs: dict[str, Any], run: Run) -> Any:
    """A functional collective (DTensor's, ``torch.distributed._functional_collectives``'s): meta kernels answer
    them on plain fake tensors, but fake tensors carrying real values would run them for real."""
    if name in ("wait_tensor", "_wrap_tensor_autograd", "isend", "irecv", "batch_p2p_ops") or name.endswith("_"):
        return args[3] if name == "batch_p2p_ops" else args[0]  # in place, or a tensor handed back as it is
    if name.startswith("all_gather_into_tensor"):
        return _made(args[0], int(args[1]), kwargs.get("out"), _tile, run)
    if name.startswith("reduce_scatter_tensor"):
        return _made(args[0], 1 / int(args[2]), kwargs.get("out"), lambda out, value, run: _chunk_of(value, out, run),
                     run)
    if name == "all_to_all_single" and args[1]:
        out = run(aten.empty.memory_format, [sum(args[1]), *args[0].shape[1:]], dtype=args[0].dtype,
                  device=args[0].device)
        _copy(out, args[0], run)
        return out
    if name.endswith("_coalesced"):
        return [run(aten.clone.default, t) for t in args[0]]
    return run(aten.clone.default, args[0])  # all_reduce, broadcast, all_to_all_single (equal splits): as it is


def _made(value: Any, scale: float, out: torch.Tensor | None, fill: Callable[[torch.Tensor, torch.Tensor, Run], None],
          run: Run) -> Any:
    """A gather's or reduce-scatter's new output (``scale`` times ``value``'s first dimension), filled; a list for a
    coalesced op's list."""
    if isinstance(value, (list, tuple)):
        return [_made(v, scale, None, fill, run) for v in value]
    if out is None:
        shape = [int(value.shape[0] * scale), *value.shape[1:]] if value.dim() else [int(scale)]
        out = run(aten.empty.memory_format, shape, dtype=value.dtype, device=value.device)
    fill(out, value, run)
    return out
