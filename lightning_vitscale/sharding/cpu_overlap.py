"""Collectives that overlap compute on CPU ranks, as CUDA streams make them overlap on a GPU. On CPU FSDP2 calls
gloo synchronously (2 CPU ranks: ~20 ms in reduce-scatters and ~13 ms in all-gathers of a 245 ms ViT step, the
bulk of the gap to DDP, whose all-reduce runs in gloo's worker thread during backward). So:

- all-gathers: FSDP2's ``unshard_async_op``, so a prefetched gather runs during the previous unit's compute;
- reduce-scatters: :class:`OverlappedReduceScatter` issues each asynchronously and waits for it at the next unit's
  or when backward ends, so no more gradient buffers are alive than under FSDP2's own.

gloo's ``reduce_scatter_tensor_coalesced`` all-reduces a clone (FSDP2 on CPU moved 1.5x DDP's bytes per step);
:class:`AllToAllReduction` sends each rank its chunks by all-to-all and sums them on wait (one input-sized temporary).

The output (FSDP2's new gradient shard) is read before backward ends only to accumulate, cast, divide (fp16) or
feed a post-accumulate-grad hook; those cases wait at once, so FSDP2 computes the same bytes as with its own. It is
also written before backward ends where a step's term reached the sharded parameter itself (an L2 term over
``self.parameters()`` taken before the forward, whose backward runs after the units'): autograd adds that gradient
in place into FSDP2's new shard, which the reduction still in flight then overwrote (seen: the term's gradient lost
in the last unit to reduce, 2 ranks). So each sharded parameter's gradient hook waits for the reductions in flight
before autograd accumulates into it; the forward never uses the shards, so the hook runs only for such terms.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import (
    ReduceScatterComm,
    has_post_accumulate_grad_hooks,
    queue_end_of_backward,
    reduce_scatter,
    set_unshard_async,
    unit_parameters,
)
from lightning_vitscale._utils import register_gradient_hook


class OverlappedReduceScatter(ReduceScatterComm):
    """One FSDP unit's reduce-scatter, asynchronous unless the unit's gradient shard is read before backward ends;
    ``pending``: the work in flight, shared by every unit of a model."""

    def __init__(self, pending: PendingReductions, params: Sequence[nn.Parameter]) -> None:
        self.pending = pending
        self.params = list(params)
        self.param_dtypes = {param.dtype for param in self.params}  # fixed once sharded: checked per call below

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType, async_op: bool = False,
    ) -> dist.Work | None:
        # At most one in flight (FSDP2 frees a reduce-scatter's input at the next one): unbounded, the whole
        # model's unsharded gradients would stay alive until backward ends.
        self.pending.wait_all()
        work = reduce_scatter_on_gloo(output_tensor, input_tensor, op, group)
        if self._read_at_once(output_tensor.dtype):
            work.wait()
        else:
            self.pending.add(work)
        return None

    def _read_at_once(self, reduce_dtype: torch.dtype) -> bool:
        """Whether FSDP2 reads the output right after this call (see the module docstring)."""
        if reduce_dtype not in (torch.float32, torch.bfloat16):
            return True  # fp16: pre/post division around the collective
        if self.param_dtypes - {reduce_dtype}:
            return True  # FSDP2 casts the output to the parameters' dtype
        # An existing gradient (accumulation) or a hook registered at any time since setup: checked per call.
        return any(param.grad is not None or has_post_accumulate_grad_hooks(param)
                   for param in self.params)


class AllToAllReduction:
    """A reduce-scatter in flight as gloo's all-to-all; :meth:`wait` sums the received chunks (row ``s``: rank
    ``s``'s chunk for this rank) into the output, divided by ``n`` for ``AVG``."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, average: bool, group: dist.ProcessGroup) -> None:
        self.output, self.average, self.world = output, average, group.size()
        self.received: torch.Tensor | None = torch.empty_like(input)
        self.work: dist.Work | None = dist.all_to_all_single(self.received, input, group=group, async_op=True)

    def wait(self) -> bool:
        if self.work is None or self.received is None:
            return True  # waited for already (wait is idempotent, like a Work's)
        self.work.wait()
        torch.sum(self.received.view(self.world, -1), dim=0, out=self.output)
        if self.average:
            self.output.div_(self.world)
        self.work = self.received = None
        return True


def reduce_scatter_on_gloo(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType,
                           group: dist.ProcessGroup) -> AllToAllReduction | dist.Work:
    """``reduce_scatter_tensor(..., async_op=True)`` at a reduce-scatter's bytes for the sum and the average; any
    other op through gloo's own call (which refuses FSDP2's pre-multiplied sum, as before)."""
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and input.is_contiguous() and output.is_contiguous():
        return AllToAllReduction(output, input, average=op == dist.ReduceOp.AVG, group=group)
    return reduce_scatter(output, input, op=op, group=group, async_op=True)


class PendingReductions:
    """Reduce-scatters in flight in the current backward, waited for by an autograd final callback, queued by each
    (idempotent): a flag "already queued" would stay set after a failed backward, whose callbacks autograd drops."""

    def __init__(self) -> None:
        self.works: list[dist.Work | AllToAllReduction] = []

    def add(self, work: dist.Work | AllToAllReduction) -> None:
        self.works.append(work)
        queue_end_of_backward(self.wait_all)

    def wait_all(self) -> None:
        """Wait for every reduce-scatter issued so far (idempotent)."""
        works, self.works = self.works, []
        for work in works:
            work.wait()

    def before_accumulating(self, grad: torch.Tensor) -> None:
        """A sharded parameter's gradient hook: what autograd adds into its gradient is added after the
        reductions in flight wrote it (see the module docstring)."""
        if self.works:
            self.wait_all()


def overlap_collectives_on_cpu(units: Iterable[FSDPModule], reduce_scatters: bool) -> None:
    """Every FSDP unit of one model overlaps its all-gathers, and its reduce-scatters where ``reduce_scatters`` (a
    1-D mesh: under hybrid sharding FSDP2 all-reduces the output at once)."""
    pending = PendingReductions()
    for unit in units:
        if reduce_scatters:
            params = unit_parameters(unit)
            unit.set_custom_reduce_scatter(OverlappedReduceScatter(pending, params))
            for param in params:  # frozen ones too: unfrozen later, the hook runs
                register_gradient_hook(param, pending.before_accumulating)
        set_unshard_async(unit, True)
