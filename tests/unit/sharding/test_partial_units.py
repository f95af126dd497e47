"""A unit of several blocks (``fully_shard([a, b])``) whose forward ran only some of them: torch 2.11's FSDP2 then
skips that unit's pre-forward at every later call (its parameters stay sharded: "got mixed torch.Tensor and
DTensor" in the next forward; ``tests/distributed/test_dropin.py`` on torch 2.11, where it failed before the fix).
``_compat.complete_partial_forwards`` (a call's end) and ``drop_partial_forwards`` (the next call's start) finish such
a unit; here both run on the installed torch's real FSDP2 state (one gloo rank), whichever torch that is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import complete_partial_forwards, drop_partial_forwards


def _unit_of_two(mesh) -> tuple[nn.Sequential, object]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard([net[0], net[1]], mesh=mesh, reshard_after_forward=True)
    fully_shard(net, mesh=mesh)
    return net, net[0]._get_fsdp_state()


def test_a_block_called_alone_leaves_its_unit_part_run_and_drop_reshards_it(mesh):
    net, state = _unit_of_two(mesh)
    net(torch.ones(2, 4))  # the root's lazy init, as setup does
    with torch.no_grad():
        net[0](torch.ones(2, 4))  # one block of the unit, alone (a callback's call)
    assert state._modules_to_run_forward == {net[1]}  # what torch 2.11 never clears before a backward
    assert not isinstance(net[0].weight, DTensor)  # gathered, its post-forward never ran
    drop_partial_forwards([state])
    assert not state._modules_to_run_forward
    assert isinstance(net[0].weight, DTensor) and isinstance(net[1].weight, DTensor)  # resharded
    out = net(torch.ones(2, 4))  # the next forward gathers the unit again
    assert out.shape == (2, 4) and not state._modules_to_run_forward


def test_a_call_that_ends_with_its_unit_part_run_completes_it_for_backward(mesh):
    net, state = _unit_of_two(mesh)
    with torch.no_grad():
        net(torch.ones(2, 4))  # the root's lazy init, as setup does
    out = net[0](torch.ones(2, 4))  # with gradients: the unit's backward hooks must still come
    out = complete_partial_forwards([state], out)
    assert not state._modules_to_run_forward and isinstance(net[0].weight, DTensor)  # resharded after forward
    out.sum().backward()  # gathered again for backward, its gradient reduced onto the shard
    assert isinstance(net[0].weight.grad, DTensor) and net[1].weight.grad is None
    assert isinstance(net[0].weight, DTensor)  # and resharded after it
