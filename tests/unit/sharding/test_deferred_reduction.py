"""A unit called several times a step reduces its gradients once, at its first call's post-backward (the last to
run, and the only one autograd has written this micro-batch's gradient for by then): every later call's post-backward
runs with the unit's gradient sync off (``sharding/deferred_reduction.py``), and the sync is what it was again after.
On the installed torch's FSDP2 (one gloo rank); the reduce-scatters it saves are counted on two ranks through
``Trainer.fit`` in ``tests/distributed/test_zoo.py``. Mutations seen failing: the sync never turned off; never
restored; restored to on after a no-sync micro-batch; the hooks kept after a step that called every unit once (or
removed after one that called a unit twice)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from lightning_vitscale._compat import requires_gradient_sync
from lightning_vitscale.sharding.deferred_reduction import DeferredReduction


@pytest.fixture
def seen(monkeypatch):
    """Each post-backward of a block unit: (which, whether a gradient of this micro-batch is there, whether it
    reduces)."""
    calls: list[tuple[str, bool, bool]] = []
    original = FSDPParamGroup.post_backward

    def recording(self, *args):
        has_grad = any(getattr(p, "_unsharded_param", None) is not None and p.unsharded_param.grad is not None
                       for p in self.fsdp_params)
        if self._module_fqn in ("0", "1"):
            calls.append((self._module_fqn, has_grad, self.reduce_grads))
        return original(self, *args)

    monkeypatch.setattr(FSDPParamGroup, "post_backward", recording)
    return calls


def _net(mesh) -> tuple[nn.Sequential, DeferredReduction]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    units = [fully_shard(net[i], mesh=mesh) for i in (0, 1)]
    fully_shard(net, mesh=mesh)
    if hasattr(net, "set_reduce_scatter_unused_params"):  # as on several ranks (torch 2.14)
        net.set_reduce_scatter_unused_params(True)
    return net, DeferredReduction(net, units)


def _two_passes(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return net(x).sum() + net[1](net[0](2 * x)).sum()  # units 0 and 1 called twice, the outer unit once


def test_only_the_first_calls_post_backward_reduces_and_the_sync_is_restored(mesh, seen):
    net, _ = _net(mesh)
    _two_passes(net, torch.randn(3, 4, requires_grad=True)).backward()
    # backward: the second calls first (no gradient yet: autograd sums both calls'), then the first calls
    assert seen == [("1", False, False), ("0", False, False), ("1", True, True), ("0", True, True)], seen
    assert requires_gradient_sync(net[0]) and requires_gradient_sync(net[1])


def test_a_no_sync_micro_batch_keeps_its_sync_off_and_the_next_reduces_both_once(mesh, seen):
    net, _ = _net(mesh)
    x = torch.randn(3, 4, requires_grad=True)
    net.set_requires_gradient_sync(False)  # Lightning's accumulation: the first micro-batch
    _two_passes(net, x).backward()
    assert not requires_gradient_sync(net[0]) and not requires_gradient_sync(net[1])
    net.set_requires_gradient_sync(True)
    _two_passes(net, x).backward()
    assert [reduces for _, _, reduces in seen] == [False] * 4 + [False, False, True, True], seen


def test_a_backward_per_call_counts_afresh(mesh, seen):
    """Manual optimization: forward, backward, forward, backward in one step: each call is its backward's only one."""
    net, _ = _net(mesh)
    x = torch.randn(3, 4, requires_grad=True)
    net(x).sum().backward()
    net[1](net[0](2 * x)).sum().backward()
    assert [reduces for _, _, reduces in seen] == [True, True, True, True], seen


def test_the_hooks_go_once_a_step_calls_every_unit_once_and_stay_where_one_runs_twice(mesh, seen):
    once, deferral = _net(mesh)
    hooks = {id(m): len(m._forward_pre_hooks) for m in (once[0], once[1], once)}
    once(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert not deferral.watching  # nothing to defer: no per-call hook or autograd node from here on
    assert all(len(m._forward_pre_hooks) == hooks[id(m)] - (1 if m is once else 2) for m in (once[0], once[1], once))
    twice, deferral = _net(mesh)
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(2):  # two steps, each calling the units twice: still watched
        _two_passes(twice, x).backward()
    assert deferral.watching
