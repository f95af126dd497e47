"""Calls to the sharded model outside a step (world-size-1 mesh): the outer unit is gathered on demand and freed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import ParallelConfig
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.outer_unit_errors import OutsideStepCallError
from lightning_vitscale.sharding.parallelize import parallelize
from tests.helpers.models import EncoderClassifier


def sharded(mesh, enable: bool = True):
    torch.manual_seed(0)
    model = EncoderClassifier(dim=32, depth=2, dropout=0.0).eval()
    reference = copy.deepcopy(model)
    root = OuterUnit(model)
    parallelize(root, model, mesh, ParallelConfig(), resolve_flag("32-true"), torch.device("cpu"))
    if enable:
        root.enable_calls_outside_steps()
    return root, model, reference


def outer_is_sharded(model: nn.Module) -> bool:
    return isinstance(model.head.weight, DTensor) and isinstance(model.patch_embed.weight, DTensor)


def test_without_the_hooks_a_call_outside_a_step_fails(mesh):
    _, model, _ = sharded(mesh, enable=False)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"), torch.no_grad():
        model(torch.randn(2, 3, 32, 32))


def test_no_grad_call_matches_the_plain_model_and_frees_the_gathered_copy(mesh):
    _, model, reference = sharded(mesh)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model.head(torch.ones(2, 32)), reference.head(torch.ones(2, 32)))  # a child alone
    assert outer_is_sharded(model)


def test_call_with_gradients_keeps_the_copy_until_release_which_drops_its_grads(mesh):
    root, model, reference = sharded(mesh)
    out = model.head(torch.ones(2, 32))
    assert not outer_is_sharded(model)  # kept: a backward may follow
    out.sum().backward()  # no block ran: FSDP's own post-backward does not fire, the gradient stays local
    expected = reference.head(torch.ones(2, 32))
    expected.sum().backward()
    assert torch.equal(model.head.weight.grad, reference.head.weight.grad)
    root.release()
    assert outer_is_sharded(model)
    model.head(torch.ones(2, 32))
    assert model.head.weight.grad is None  # not carried into the next step's gradients


def test_a_step_starts_from_the_updated_shards_and_an_eval_step_frees_them(mesh):
    root, model, _ = sharded(mesh)
    shard = model.head.weight  # what the optimizer holds and updates
    model.head(torch.ones(2, 32))  # gathered with gradients on, kept
    with torch.no_grad():
        shard.to_local().zero_()  # an optimizer step: the shards change, the gathered copy is stale
        out = root(torch.randn(2, 3, 32, 32))  # a step must gather the updated shards
    assert torch.equal(out, model.head.bias.full_tensor().expand(2, -1))
    assert outer_is_sharded(model)  # an evaluation step keeps nothing gathered


def test_failed_gather_names_the_cause(mesh, monkeypatch):
    root, model, _ = sharded(mesh)

    def times_out(*args, **kwargs):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    monkeypatch.setattr(root, "unshard", times_out)
    with pytest.raises(OutsideStepCallError, match="every rank must join.*Timed out waiting"), torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert root._depth == 0  # the failed call left no state behind


def test_bf16_model_called_outside_a_step(mesh):
    """BF16 O2: the gathered outer unit computes in bf16 (inputs cast by its layers), norms stay fp32."""
    torch.manual_seed(0)
    model = EncoderClassifier(dim=32, depth=2, dropout=0.0).eval()
    reference = copy.deepcopy(model)
    root = OuterUnit(model)
    parallelize(root, model, mesh, ParallelConfig(), resolve_flag("bf16-mixed"), torch.device("cpu"))
    root.enable_calls_outside_steps()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        expected = reference(x)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected, atol=0.1, rtol=0.1)
    assert outer_is_sharded(model)
