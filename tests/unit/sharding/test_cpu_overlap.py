"""CPU overlap's bookkeeping, in one process: when a reduce-scatter may stay in flight, and that every one left in
flight is waited for when backward ends, also after a backward that failed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vitscale.sharding.cpu_overlap import OverlappedReduceScatter, PendingReductions
from lightning_vitscale.sharding.settings import ShardingPolicy


class FakeWork:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1
        return True


class AddsWorkInBackward(torch.autograd.Function):
    """A node whose backward issues a "reduce-scatter" (as FSDP2's post-backward hook does), then maybe fails."""

    @staticmethod
    def forward(ctx, x, pending, work, fail):  # type: ignore[override]
        ctx.pending, ctx.work, ctx.fail = pending, work, fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.pending.add(ctx.work)
        assert ctx.work.waited == 0  # in flight while the rest of backward runs
        if ctx.fail:
            raise RuntimeError("a failing backward")
        return grad, None, None, None


def backward_through(pending: PendingReductions, works: list[FakeWork], fail: bool = False) -> None:
    x = torch.ones(2, requires_grad=True)
    y = x
    for work in works:
        y = AddsWorkInBackward.apply(y, pending, work, fail)
    y.sum().backward()


def test_every_reduce_scatter_of_a_backward_is_waited_for_when_it_ends():
    pending, works = PendingReductions(), [FakeWork(), FakeWork(), FakeWork()]
    backward_through(pending, works)
    assert [w.waited for w in works] == [1, 1, 1] and pending.works == []


def test_a_failed_backward_does_not_leave_later_reductions_unwaited():
    """Autograd drops the final callbacks of a failed pass: the next backward still waits, for both."""
    pending, lost, later = PendingReductions(), FakeWork(), FakeWork()
    with pytest.raises(RuntimeError, match="a failing backward"):
        backward_through(pending, [lost], fail=True)
    assert lost.waited == 0
    backward_through(pending, [later])
    assert lost.waited == 1 and later.waited == 1


def _params(dtype=torch.float32, grad: bool = False, hook: bool = False) -> list[nn.Parameter]:
    param = nn.Parameter(torch.zeros(4, dtype=dtype))
    if grad:
        param.grad = torch.zeros_like(param)
    if hook:
        param.register_post_accumulate_grad_hook(lambda p: None)
    return [param]


@pytest.mark.parametrize(
    ("params", "reduce_dtype", "at_once"),
    [
        (_params(), torch.float32, False),  # the common case: a fresh gradient shard, read after backward
        (_params(torch.bfloat16), torch.bfloat16, False),
        (_params(grad=True), torch.float32, True),  # accumulation: FSDP2 adds the output to the existing grad
        (_params(), torch.bfloat16, True),  # fp32 parameters, bf16 reduction: FSDP2 casts the output at once
        (_params(torch.float16), torch.float16, True),  # fp16: divided after the collective
        (_params(hook=True), torch.float32, True),  # optimizer in backward reads param.grad in the hook
    ],
)
def test_a_reduce_scatter_waits_at_once_where_fsdp2_reads_its_output_before_backward_ends(
    params, reduce_dtype, at_once
):
    comm = OverlappedReduceScatter(PendingReductions(), params)
    assert comm._read_at_once(reduce_dtype) is at_once


def test_prefetch_defaults_to_one_unit_ahead_on_cpu_and_to_fsdp2s_own_on_gpus():
    assert ShardingPolicy().prefetch_on("cpu") == 1
    assert ShardingPolicy().prefetch_on("cuda") == 0
    assert ShardingPolicy(prefetch=0).prefetch_on("cpu") == 0
    assert ShardingPolicy(prefetch=2).prefetch_on("cuda") == 2
    with pytest.raises(ValueError, match="None or an int >= 0"):
        ShardingPolicy(prefetch=-1)


class ReduceScattersInBackward(torch.autograd.Function):
    """Three units' reduce-scatters issued from one backward, as FSDP2's post-backward hooks issue them."""

    @staticmethod
    def forward(ctx, x, comm, seen):  # type: ignore[override]
        ctx.comm, ctx.seen = comm, seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        import torch.distributed as dist

        for _ in range(3):
            ctx.comm(output_tensor=torch.empty(4), input_tensor=torch.ones(4), group=dist.group.WORLD,
                     op=dist.ReduceOp.SUM)
            ctx.seen.append(len(ctx.comm.pending.works))
        return grad, None, None


def test_at_most_one_reduce_scatter_is_in_flight(mesh):
    """Each reduce-scatter waits for the previous one before it starts: no more gradient buffers alive than under
    FSDP2's own (an unbounded queue held the whole model's unsharded gradients until backward ended)."""
    pending, seen = PendingReductions(), []
    comm = OverlappedReduceScatter(pending, _params())
    x = torch.ones(2, requires_grad=True)
    ReduceScattersInBackward.apply(x, comm, seen).sum().backward()
    assert seen == [1, 1, 1] and pending.works == []
