"""Sharded gradient clipping equals torch's unsharded clipping, including mixed DTensor/plain gradients."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.precision.clipping import clip_grad_norm, grad_norm, total_grad_norm
from lightning_vitscale.sharding.fsdp import shard_module
from tests.helpers.models import Classifier, loader
from tests.helpers.state import full
from tests.unit.sharding.test_compute_copies import without_dropout


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_gradients_whole_on_one_rank_are_clipped_bit_for_bit_as_torch_clips(mesh, norm_type, dtype):
    """One rank (a mesh of one): the norm is torch's own (the norm of the per-tensor norms), not a sum of squares,
    which rounds apart (seed 3: 1.9e-6 apart in the fp32 2-norm), in fp32 and in bf16 (``"bf16-true"``'s gradients).
    Mutation seen failing: the sum of squares kept on one rank."""
    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.Linear(64, 3)).to(dtype)
    model = copy.deepcopy(reference)
    shard_module(model[0], mesh, MixedPrecisionPolicy(), False)
    shard_module(model[2], mesh, MixedPrecisionPolicy(), False)  # model[3] plain: a mixed set
    x = torch.randn(16, 64, dtype=dtype)
    reference(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type=norm_type)
    got = clip_grad_norm(model.parameters(), 0.1, norm_type=norm_type)
    assert torch.equal(got, expected)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        grad = ours.grad.full_tensor() if hasattr(ours.grad, "full_tensor") else ours.grad
        assert torch.equal(grad, theirs.grad)


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
    for key, value in expected.items():  # one rank: Lightning's arithmetic, so its numbers bit for bit
        assert torch.equal(got[key].cpu(), value), key
    with pytest.raises(RuntimeError, match="data is not allocated"):
        lightnings(model, norm_type)  # why it exists


class WarmedUp(Classifier):
    """A learning-rate warm-up written in ``optimizer_step``, as many LightningModules do."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        for group in optimizer.param_groups:
            group["lr"] = min(1.0, (self.trainer.global_step + 1) / 4) * 1e-2
        optimizer.step(closure=optimizer_closure)


def test_one_device_clipped_by_norm_trains_as_ddp_bit_for_bit():
    """``gradient_clip_val`` with a warm-up on one device through ``Trainer.fit``: DDP's weights bit for bit (the step
    computes on one rank's compute copies; the norm is torch's). Mutation seen failing: the sum of squares kept on
    one rank (weights 3e-6 apart after 6 steps)."""
    states = []
    for strategy in ("ddp", VitScaleStrategy()):
        L.seed_everything(0, verbose=False)
        module = without_dropout(WarmedUp())  # the strategy's setup draws random numbers
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=6, gradient_clip_val=0.05, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, limit_val_batches=0).fit(module, loader(48, batch_size=4))
        states.append({name: full(p) for name, p in module.named_parameters()})
    ddp, ours = states
    assert all(torch.equal(ours[name], ddp[name]) for name in ddp)
