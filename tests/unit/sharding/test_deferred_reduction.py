"""A unit called several times a step asks FSDP2 for zero gradients (``set_reduce_scatter_unused_params``) only at
its first call's post-backward, the last to run and the only one autograd has written a gradient for by then
(``sharding/deferred_reduction.py``); every later call's post-backward runs with it off, and it is on again after.
On the installed torch's FSDP2 (one gloo rank); the reduce-scatters it saves are counted on two ranks in
``tests/distributed/test_zoo.py``. Mutations seen failing: the flag never turned off; never turned back on; the
hooks kept after a step that called every unit once (or removed after one that called a unit twice)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from lightning_vitscale.sharding.deferred_reduction import DeferredZeroGradients
from tests.helpers.torch_features import needs_unused_parameter_reduction

pytestmark = needs_unused_parameter_reduction


@pytest.fixture
def seen(monkeypatch):
    """Each post-backward of a parameter group: (whether any gradient is there, the zeros flag)."""
    calls: list[tuple[str, bool, bool]] = []
    original = FSDPParamGroup.post_backward

    def recording(self, *args):
        has_grad = any(getattr(p, "_unsharded_param", None) is not None and p.unsharded_param.grad is not None
                       for p in self.fsdp_params)
        calls.append((self._module_fqn, has_grad, self.reduce_scatter_unused_params))
        return original(self, *args)

    monkeypatch.setattr(FSDPParamGroup, "post_backward", recording)
    return calls


def _net(mesh) -> tuple[nn.Sequential, DeferredZeroGradients]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    units = [fully_shard(net[i], mesh=mesh) for i in (0, 1)]
    fully_shard(net, mesh=mesh)
    net.set_reduce_scatter_unused_params(True)
    return net, DeferredZeroGradients(net, units)


class TwoPasses(nn.Module):
    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).sum() + self.net(2 * x).sum()


def test_only_the_first_calls_post_backward_asks_for_zeros_and_the_flag_is_restored(mesh, seen):
    net, _ = _net(mesh)
    x = torch.randn(3, 4, requires_grad=True)
    (net(x).sum() + net[1](net[0](2 * x)).sum()).backward()  # units 0 and 1 called twice, the outer unit once
    blocks = [call for call in seen if call[0] in ("0", "1")]
    # backward: the second calls first (no gradient yet: autograd sums both calls'), then the first calls
    assert blocks == [("1", False, False), ("0", False, False), ("1", True, True), ("0", True, True)], seen
    assert all(group.reduce_scatter_unused_params for unit in (net[0], net[1])
               for group in unit._get_fsdp_state()._fsdp_param_groups)


def test_a_backward_per_call_counts_afresh(mesh, seen):
    """Manual optimization: forward, backward, forward, backward in one step: each call is its backward's only one."""
    net, _ = _net(mesh)
    x = torch.randn(3, 4, requires_grad=True)
    net(x).sum().backward()
    net[1](net[0](2 * x)).sum().backward()
    assert [call[2] for call in seen if call[0] in ("0", "1")] == [True, True, True, True], seen


def test_the_hooks_go_once_a_step_calls_every_unit_once_and_stay_where_one_runs_twice(mesh, seen):
    once, deferral = _net(mesh)
    hooks = {id(m): len(m._forward_pre_hooks) for m in (once[0], once[1], once)}
    once(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert not deferral.watching  # nothing to defer: no per-call hook or autograd node from here on
    assert all(len(m._forward_pre_hooks) == hooks[id(m)] - (1 if m is once else 2) for m in (once[0], once[1], once))
    twice, deferral = _net(mesh)
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(2):  # two steps, each calling the units twice: still watched
        (twice(x).sum() + twice[1](twice[0](2 * x)).sum()).backward()
    assert deferral.watching
