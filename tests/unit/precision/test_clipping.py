"""Sharded gradient clipping equals torch's unsharded clipping, including mixed DTensor/plain gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_vitscale.precision.clipping import clip_grad_norm, grad_norm, total_grad_norm
from lightning_vitscale.sharding.fsdp import shard_module


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_matches_torch_on_sharded_and_plain_grads(mesh, norm_type):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    shard_module(model[0], mesh, MixedPrecisionPolicy(), False)  # model[1] stays plain: a mixed set
    x = torch.randn(4, 8)
    reference(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type=norm_type)
    got = clip_grad_norm(model.parameters(), 0.1, norm_type=norm_type)
    torch.testing.assert_close(got, expected)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        grad = ours.grad.full_tensor() if hasattr(ours.grad, "full_tensor") else ours.grad
        torch.testing.assert_close(grad, theirs.grad)


def test_no_clipping_below_the_threshold(mesh):
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.1)
    assert total_grad_norm([p]).item() == pytest.approx(math.sqrt(0.03))
    clip_grad_norm([p], 10.0)
    torch.testing.assert_close(p.grad, torch.full((3,), 0.1))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_grad_norm_gives_lightnings_keys_and_the_unsharded_values(mesh, norm_type):
    """``lightning_vitscale.grad_norm`` on sharded and plain gradients at once: Lightning's keys, the values Lightning's
    own gives on the unsharded model (which fails on a DTensor gradient)."""
    from lightning.pytorch.utilities import grad_norm as lightnings

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    shard_module(model[0], mesh, MixedPrecisionPolicy(), False)  # model[1] stays plain: two layouts
    x = torch.randn(4, 8)
    reference(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    expected, got = lightnings(reference, norm_type), grad_norm(model, norm_type)
    assert list(got) == list(expected) and len(got) == 5
    for key, value in expected.items():
        torch.testing.assert_close(got[key].cpu(), value.float())
    with pytest.raises(RuntimeError, match="data is not allocated"):
        lightnings(model, norm_type)  # why it exists
