"""A gradient reaching a shard itself during backward (a term on the parameters taken before the forward) waits for
the unit's reduction streams first, on the stream autograd accumulates on (``sharding/direct_gradients.py``); a
step without such a term waits for nothing. The streams are stand-ins here (CPU); the GPU check:
``tests/gpu/test_strategy_gpu.py``. Mutation seen failing: the hook not registered."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import fsdp_param_groups, reduction_streams
from lightning_vitscale.sharding import direct_gradients


class Stream:
    """Records which streams it was made to wait for."""

    def __init__(self, name: str) -> None:
        self.name, self.waited_for, self.host_waits = name, [], 0

    def wait_stream(self, other: Stream) -> None:
        self.waited_for.append(other.name)

    def synchronize(self) -> None:
        self.host_waits += 1


@pytest.mark.parametrize("offloaded", [False, True])
def test_a_term_on_the_shards_waits_for_the_reductions_and_a_plain_step_does_not(mesh, monkeypatch, offloaded):
    """``offloaded``: the host waits for the reductions (the shards' gradients are copied to it asynchronously)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    block = fully_shard(net[0], mesh=mesh)
    outer = fully_shard(net, mesh=mesh)
    compute, reduce = Stream("compute"), Stream("reduce-scatter")
    monkeypatch.setattr(direct_gradients, "reduction_streams", lambda unit: [reduce])
    monkeypatch.setattr(direct_gradients, "current_stream", lambda device: compute)
    net[0].requires_grad_(False)  # frozen at setup (a backbone), unfrozen later: hooked all the same
    direct_gradients.hook_shards([outer, block], offloaded)
    assert not any(p.requires_grad for p in net[0].parameters())
    net[0].requires_grad_(True)
    x = torch.randn(3, 4)

    net(x).sum().backward()
    assert compute.waited_for == []  # the forward computes on gathered tensors: no shard is reached itself

    term = sum(p.pow(2).sum().full_tensor() for p in net.parameters() if isinstance(p, DTensor))
    (net(x).sum() + term).backward()
    if offloaded:
        assert reduce.host_waits == 4 and compute.waited_for == []
    else:  # once per shard the term reached, before accumulating
        assert compute.waited_for == ["reduce-scatter"] * 4 and reduce.host_waits == 0


def test_a_unit_s_reduction_streams_are_fsdp2_s_once_its_first_forward_made_them(mesh):
    net = nn.Sequential(nn.Linear(4, 4))
    unit = fully_shard(net, mesh=mesh)
    assert reduction_streams(unit) == []
    net(torch.randn(2, 4)).sum().backward()
    context = fsdp_param_groups(unit)[0].comm_ctx
    assert reduction_streams(unit) == [context.reduce_scatter_stream, context.all_reduce_stream]
