"""Collectives that overlap compute on CPU ranks, as CUDA streams make them overlap on a GPU.

On a GPU, FSDP2 issues its all-gathers and reduce-scatters on side streams: the host returns at once and the
compute of the next block runs while NCCL moves the bytes. On CPU there are no streams: FSDP2 calls gloo
synchronously, so the step's thread waits for every collective (measured on 2 CPU ranks: ~20 ms in
reduce-scatters and ~13 ms in all-gathers of a 245 ms ViT step, the bulk of the gap to DDP, whose gloo
all-reduce runs in gloo's worker thread during backward). Two changes give CPU ranks the GPU's overlap:

- all-gathers: FSDP2's ``unshard_async_op`` makes the pre-forward/pre-backward and prefetched all-gathers
  asynchronous (a ``Work`` waited for at the unit's first use), so a prefetched gather runs during the previous
  unit's compute;
- reduce-scatters: :class:`OverlappedReduceScatter`, set as every unit's reduce-scatter, issues the collective
  with ``async_op=True`` and waits for it when the next unit's reduce-scatter is issued, or when backward ends
  (an autograd final callback): a unit's reduce-scatter runs while the previous unit's backward computes, and
  no more gradient buffers are alive than under FSDP2's own (which frees a reduce-scatter's input at the next).

gloo has no reduce-scatter of its own: ``ProcessGroupGloo.reduce_scatter_tensor_coalesced`` clones the input,
all-reduces the clone and copies out this rank's chunk, so every reduce-scatter moves an all-reduce's bytes (twice
a reduce-scatter's) and FSDP2 on CPU ranks moved 1.5x DDP's bytes per step. :class:`AllToAllReduction` is the
reduce-scatter itself: gloo's all-to-all sends each rank its chunk of every other rank's input (a ring
reduce-scatter's ``(n - 1) / n`` of the buffer), and this rank sums the ``n`` chunks it received when the work is
waited for. Its one temporary (the received chunks) is the size of the input, as gloo's clone was.

The reduce-scatter's output is FSDP2's new gradient shard, viewed (not copied) into ``param.grad``; it is read
before backward ends only when FSDP2 adds it to a gradient that already exists (accumulation), casts it to
another dtype, divides it after the collective (fp16), or hands it to a post-accumulate-grad hook (optimizer in
backward). Those cases wait at once, so the values FSDP2 computes are the same bytes as with its own
reduce-scatter.
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


class OverlappedReduceScatter(ReduceScatterComm):
    """One FSDP unit's reduce-scatter, asynchronous unless the unit's gradient shard is read before backward ends.

    ``pending`` is shared by every unit of a model: the one work still in flight, waited for when the next unit's
    reduce-scatter starts or when backward ends. ``params`` are the unit's parameters, checked at each call for the
    cases that read the output at once.
    """

    def __init__(self, pending: PendingReductions, params: Sequence[nn.Parameter]) -> None:
        self.pending = pending
        self.params = list(params)
        self.param_dtypes = {param.dtype for param in self.params}  # fixed once sharded: checked per call below

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        # At most one in flight: the previous unit's finishes before this one starts, as FSDP2 itself frees a
        # reduce-scatter's input only at the next one. Unbounded, every unit's input (the whole model's unsharded
        # gradients) would stay alive until backward ends.
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
    """A reduce-scatter in flight as gloo's all-to-all; :meth:`wait` sums the received chunks into the output.

    ``input`` is ``n`` equal chunks, chunk ``r`` going to rank ``r`` (FSDP2's reduce-scatter input); after the
    all-to-all, row ``s`` of ``received`` is rank ``s``'s chunk for this rank, so their sum (divided by ``n`` for
    ``AVG``) is this rank's reduced shard, what ``reduce_scatter_tensor`` writes into ``output``.
    """

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
    """``reduce_scatter_tensor(output, input, op, group, async_op=True)`` moving a reduce-scatter's bytes, not an
    all-reduce's (module docstring): the sum and the average; any other op goes through gloo's own call, which does
    what it did before (gloo refuses FSDP2's pre-multiplied sum for a custom gradient divide factor, as it did)."""
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and input.is_contiguous() and output.is_contiguous():
        return AllToAllReduction(output, input, average=op == dist.ReduceOp.AVG, group=group)
    return reduce_scatter(output, input, op=op, group=group, async_op=True)


class PendingReductions:
    """Reduce-scatters in flight in the current backward, waited for by an autograd final callback.

    Each one queues the callback (a few per step, and idempotent): a flag "already queued" would stay set for
    good when a backward fails after one was queued, since autograd drops the callbacks of a failed pass.
    """

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


def overlap_collectives_on_cpu(units: Iterable[FSDPModule], reduce_scatters: bool) -> None:
    """Make ``units`` (every FSDP unit of one model on CPU ranks) overlap their collectives with compute: the
    all-gathers always, the reduce-scatters where ``reduce_scatters`` (a 1-D mesh: under hybrid sharding FSDP2
    all-reduces the reduce-scatter's output at once). The units share one :class:`PendingReductions`."""
    pending = PendingReductions()
    for unit in units:
        if reduce_scatters:
            unit.set_custom_reduce_scatter(OverlappedReduceScatter(pending, unit_parameters(unit)))
        set_unshard_async(unit, True)
