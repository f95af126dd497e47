"""Elementwise optimizers step on their DTensor parameters' local shards (kernels/local_step.py).

The update must be the DTensor step's, bit for bit; the state must stay DTensors (the same objects after the
first step), so checkpoints and ``ShardedEMA`` see what they saw before; everything is put back when a step
raises; optimizers that are not elementwise, and gradients placed differently from their parameter, keep the
DTensor step. Mutations seen failing: the state not wrapped back (the first test), the param groups not restored
in ``finally`` (the raising step), the closure's result not returned (the Lightning-style closure), every
optimizer class allowed (Adafactor's test), the placements check removed (the mismatched-gradient test).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from lightning_vitscale.kernels import prepare_optimizers
from lightning_vitscale.kernels.local_step import LocalShardStep, on_local_shards, step_on_local_shards


def _sharded(mesh, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=True),
        lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True, foreach=False),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    ],
)
def test_local_step_is_the_dtensor_step_bit_for_bit_and_state_stays_dtensor(mesh, make) -> None:
    reference, local = _sharded(mesh), _sharded(mesh)
    reference_optimizer, local_optimizer = make(reference.parameters()), make(local.parameters())
    assert step_on_local_shards([local_optimizer]) and isinstance(local_optimizer.step, LocalShardStep)
    _train(reference, reference_optimizer, 1)
    _train(local, local_optimizer, 1)
    first_state = {k: dict(v) for k, v in local_optimizer.state.items()}
    _train(reference, reference_optimizer, 3)
    _train(local, local_optimizer, 3)
    for a, b in zip(reference.parameters(), local.parameters(), strict=True):
        assert isinstance(b, DTensor) and torch.equal(a.full_tensor(), b.full_tensor())
    assert len(local_optimizer.state) == len(reference_optimizer.state) == len(list(local.parameters()))
    for param, state in local_optimizer.state.items():
        assert isinstance(param, DTensor)
        reference_state = reference_optimizer.state[dict(zip(local.parameters(), reference.parameters()))[param]]
        for key, value in state.items():
            expected = reference_state[key]
            assert type(value) is type(expected), key
            assert torch.equal(value.full_tensor(), expected.full_tensor()) if isinstance(value, DTensor) else (
                torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected
            )
            if isinstance(value, DTensor):
                assert value.placements == param.placements and value is first_state[param][key]  # in place
    assert all(group["params"][0] is p for group, p in zip(local_optimizer.param_groups, [next(local.parameters())]))
    assert all(p.grad is None for p in (q._local_tensor for q in local.parameters()))  # nothing left on locals
    torch.testing.assert_close(  # a checkpoint of it is the reference's
        local_optimizer.state_dict()["param_groups"], reference_optimizer.state_dict()["param_groups"]
    )


def test_closure_runs_first_and_its_loss_is_returned(mesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step_on_local_shards([optimizer])
    before = [p.full_tensor().clone() for p in model.parameters()]

    def closure() -> torch.Tensor:  # as Lightning's: zero_grad and backward inside the closure
        optimizer.zero_grad()
        loss = model(torch.randn(4, 6)).square().mean()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert all(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))


def test_a_step_that_raises_puts_everything_back(mesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, 1)
    params, state = list(optimizer.param_groups[0]["params"]), dict(optimizer.state)
    with pytest.raises(RuntimeError, match="boom"), on_local_shards(optimizer):
        assert not isinstance(optimizer.param_groups[0]["params"][0], DTensor)
        raise RuntimeError("boom")
    assert optimizer.param_groups[0]["params"] == params and all(isinstance(p, DTensor) for p in params)
    assert set(optimizer.state) == set(state) and all(isinstance(k, DTensor) for k in optimizer.state)
    assert all(p._local_tensor.grad is None for p in params)


def test_optimizers_that_are_not_elementwise_keep_the_dtensor_step(mesh) -> None:
    model = _sharded(mesh)

    class MyAdamW(torch.optim.AdamW):  # may override step with anything
        pass

    kept = [torch.optim.Adafactor(model.parameters()), MyAdamW(model.parameters()),
            torch.optim.AdamW(model.parameters(), differentiable=True)]
    assert step_on_local_shards(kept) == []
    assert all("step" not in optimizer.__dict__ for optimizer in kept)
    adamw = torch.optim.AdamW(model.parameters())
    lines = prepare_optimizers([adamw], fused=False)
    assert lines == ["optimizer 0 (AdamW): steps on each parameter's local shard"]
    assert prepare_optimizers([adamw], fused=False) == []  # once


def test_a_gradient_placed_unlike_its_parameter_keeps_the_dtensor_step(mesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step_on_local_shards([optimizer])
    _train(model, optimizer, 1)
    param = next(model.parameters())
    param.grad = DTensor.from_local(torch.ones_like(param._local_tensor), mesh, [Replicate()], run_check=False)
    with on_local_shards(optimizer) as swapped:
        assert swapped is False and optimizer.param_groups[0]["params"][0] is param
    plain = copy.deepcopy(nn.Linear(2, 2))
    with on_local_shards(torch.optim.SGD(plain.parameters(), lr=0.1)) as swapped:
        assert swapped is False  # no DTensor at all
