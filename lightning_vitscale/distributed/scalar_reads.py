"""``.item()``, ``float()``, ``int()`` and ``bool()`` of a sharded tensor give the whole tensor's number, as DDP's do.

A reduction of a sharded parameter or gradient (``p.grad.norm()``, ``p.abs().max()``, a sum of squares over
``self.parameters()``) is a ``Partial`` DTensor: each rank holds its part, combined only when an operation needs the
whole. Torch's ``.item()`` of it returns this rank's part (pytorch#166638, still so in torch 2.14): the number a user
logs or tests (``if norm > 10``) silently differs from DDP's and from rank to rank. A one-element tensor sharded over
the ranks (a ``[1]`` scale's shard) holds its element on one rank only: torch's ``.item()`` fails on the others.

So, while a process group this strategy started lives, the scalar read of a DTensor not replicated on every mesh
dimension reads the whole value: every rank first agrees on the side group (``collective_guard``), then the value is
gathered. A DTensor logged with ``self.log`` is made whole as it is logged (every rank logs, in the step's order):
Lightning reads the progress bar's values again on rank 0 alone, where a read that communicates would meet the other
ranks' next reads. The handshake is what makes the DDP habit of reading on one rank only (``if trainer.is_global_zero:
print(p.grad.norm().item())``) fail naming the fix, instead of sending a reduction that meets another rank's FSDP
all-gather (gloo aborts on the sizes; NCCL may hang or mix the two).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import FakeTensor, dtensor_local, dtensor_op_handlers, log_whole_values
from lightning_vitscale.distributed import collective_guard

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default


class ScalarReadError(RuntimeError):
    """A scalar read of a sharded tensor that not every rank made: nothing was gathered."""


def read_whole_scalars() -> None:
    """Make a DTensor's scalar read gather the whole value, and a DTensor logged with ``self.log`` a whole plain
    tensor as it is logged (process-wide: DTensor's dispatcher and Lightning's logged-value class are one for all)."""
    handlers = dtensor_op_handlers()
    if handlers.get(_SCALAR_READ) is not _read_whole:
        handlers[_SCALAR_READ] = _read_whole
    log_whole_values(_logged_whole)


def _whole_value(tensor: DTensor) -> torch.Tensor:
    """The whole plain tensor of ``tensor``: its local one where that is whole, else every rank's part combined after
    the side group's handshake (:class:`ScalarReadError` where not every rank asks)."""
    local = dtensor_local(tensor)
    if whole_here(tensor) or isinstance(local, FakeTensor) or local.is_meta or collective_guard.side_group() is None:
        return local  # the value is here, or there is nothing to gather it with
    try:
        collective_guard.agree(collective_guard.SCALAR_READ, tensor.numel(), _layout_check(tensor))
    except collective_guard.NotJoinedError as error:
        raise ScalarReadError(collective_guard.not_joined(
            "`.item()` / `float()` / `bool()` or `self.log` of a sharded tensor (a DTensor: a norm, sum or max of a"
            " sharded parameter or gradient) reads the whole tensor's number, as under DDP, by combining every rank's"
            " part", error,
            "Read or log it on every rank, then use it on one: `norm = p.grad.norm().item()` before `if"
            " trainer.is_global_zero:`; `lightning_vitscale.grad_norm` for gradient norms; `.to_local()` for this"
            " rank's own part alone (no communication).",
        )) from error
    return tensor.full_tensor()


def _read_whole(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return op(_whole_value(args[0]), **kwargs)


def _logged_whole(value: Any, rank_zero_only: bool) -> Any:
    """What ``self.log`` keeps of ``value``: a DTensor made whole and plain as it is logged, on every rank in the
    order the step logs (Lightning reads pbar values again on rank 0 alone, where a read must not communicate)."""
    if not isinstance(value, DTensor):
        return value
    if whole_here(value):
        return value.to_local()  # whole here (its graph kept: `self.log(..., enable_graph=True)`)
    if rank_zero_only:
        raise ScalarReadError(
            "`self.log(..., rank_zero_only=True)` of a sharded tensor (a DTensor: a norm, sum or max of a sharded"
            " parameter or gradient): its number combines every rank's part, which rank 0 alone cannot read. Log it"
            " from every rank (the default `rank_zero_only=False`), or compute `value = t.full_tensor()` on every rank"
            " and log `value` on rank 0."
        )
    return _whole_value(value)


def whole_here(tensor: DTensor) -> bool:
    """Each rank holds the whole value: one rank, or replicated on every mesh dimension."""
    return tensor.device_mesh.size() == 1 or all(placement.is_replicate() for placement in tensor.placements)


def _layout_check(tensor: DTensor) -> int:
    """Two ranks reading tensors of different layouts at the same point read different tensors."""
    return collective_guard.fingerprint([str(tuple(tensor.shape)), str(tensor.placements)])
