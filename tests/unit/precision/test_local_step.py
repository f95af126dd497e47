"""Elementwise optimizers step on their DTensor parameters' local shards (precision/local_step.py).

The update must be the DTensor step's, bit for bit; the state must stay DTensors (the same objects after the first
step), so checkpoints and ``ShardedEMA`` see what they saw before; everything is put back when a step raises;
optimizers that are not elementwise, and gradients placed otherwise than their parameter, keep the DTensor step.
Mutations seen failing: the new state left as plain tensors (the first test), the param groups not restored in
``finally`` (the raising step), ``type(...) in`` widened to ``isinstance`` (the subclass), the placements check
removed (the mismatched gradient), the plugin stepping outside the block or returning the step's ``None`` (the last),
the swap back's in-place check reduced to the state dict's identity (the replaced state).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from lightning_vitscale.precision import VitScalePrecision
from lightning_vitscale.precision.local_step import on_local_shards


def _sharded(mesh, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, local: bool) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        with on_local_shards(optimizer) if local else mock.MagicMock() as swapped:
            assert not local or swapped
            optimizer.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=True),
        lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True, foreach=False),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    ],
)
def test_local_step_is_the_dtensor_step_bit_for_bit_and_state_stays_dtensor(mesh, make) -> None:
    reference, local = _sharded(mesh), _sharded(mesh)
    reference_optimizer, local_optimizer = make(reference.parameters()), make(local.parameters())
    _train(reference, reference_optimizer, 1, local=False)
    _train(local, local_optimizer, 1, local=True)
    first_state = {k: dict(v) for k, v in local_optimizer.state.items()}
    _train(reference, reference_optimizer, 3, local=False)
    _train(local, local_optimizer, 3, local=True)
    for a, b in zip(reference.parameters(), local.parameters(), strict=True):
        assert isinstance(b, DTensor) and torch.equal(a.full_tensor(), b.full_tensor())
    twin = dict(zip(local.parameters(), reference.parameters()))
    assert len(local_optimizer.state) == len(reference_optimizer.state) == len(twin)
    for param, state in local_optimizer.state.items():
        assert isinstance(param, DTensor)
        for key, value in state.items():
            expected = reference_optimizer.state[twin[param]][key]
            assert type(value) is type(expected), key
            if isinstance(value, DTensor):
                assert value.placements == param.placements and value is first_state[param][key]  # in place
                assert torch.equal(value.full_tensor(), expected.full_tensor())
            else:
                assert torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected
    assert all(p._local_tensor.grad is None for p in local.parameters())  # nothing left on the locals
    assert local_optimizer.state_dict()["param_groups"] == reference_optimizer.state_dict()["param_groups"]


def test_a_step_that_raises_puts_everything_back(mesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, 1, local=True)
    params, state = list(optimizer.param_groups[0]["params"]), dict(optimizer.state)
    with pytest.raises(RuntimeError, match="boom"), on_local_shards(optimizer):
        assert not isinstance(optimizer.param_groups[0]["params"][0], DTensor)
        raise RuntimeError("boom")
    assert optimizer.param_groups[0]["params"] == params and all(isinstance(p, DTensor) for p in params)
    assert set(optimizer.state) == set(state) and all(isinstance(k, DTensor) for k in optimizer.state)
    assert all(p._local_tensor.grad is None for p in params)


def test_state_replaced_during_a_step_reaches_the_dtensor_state(mesh) -> None:
    """Swapping back skips the merge where the step updated the state in place (Adam after its first step); a value
    the step replaced, or a key it added, must still come back as the parameter's DTensor state."""
    model = _sharded(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, 2, local=True)
    param = next(model.parameters())
    before = optimizer.state[param]["exp_avg"]
    model(torch.randn(4, 6)).square().mean().backward()
    with on_local_shards(optimizer):
        optimizer.step()
        local_state = optimizer.state[param._local_tensor]
        local_state["exp_avg"] = torch.full_like(local_state["exp_avg"], 7.0)
        local_state["seen"] = 1
    after = optimizer.state[param]
    assert isinstance(after["exp_avg"], DTensor) and after["exp_avg"].placements == param.placements
    assert after["exp_avg"] is not before and torch.equal(after["exp_avg"]._local_tensor,
                                                          torch.full_like(before._local_tensor, 7.0))
    assert after["seen"] == 1
    untouched = optimizer.state[list(model.parameters())[1]]["exp_avg"]
    assert isinstance(untouched, DTensor)


def test_differentiable_steps_and_gradients_placed_otherwise_keep_the_dtensor_step(mesh) -> None:
    """And on one rank (this mesh) any other optimizer steps the local tensors, each a whole parameter there (on
    several ranks only the elementwise ones do: ``tests/distributed/test_precision.py``)."""
    model = _sharded(mesh)

    class MyAdamW(torch.optim.AdamW):  # may override step with anything
        pass

    kept = [torch.optim.AdamW(model.parameters(), differentiable=True),
            torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)]  # no DTensor at all
    whole = [torch.optim.Adafactor(model.parameters()), MyAdamW(model.parameters())]
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, local=True)  # every parameter has a gradient
    for optimizer in kept:
        with on_local_shards(optimizer) as swapped:
            assert swapped is False and isinstance(optimizer.param_groups[0]["params"][0], DTensor | nn.Parameter)
    for optimizer in whole:
        with on_local_shards(optimizer) as swapped:
            assert swapped is True and not isinstance(optimizer.param_groups[0]["params"][0], DTensor)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    param = next(model.parameters())
    param.grad = DTensor.from_local(torch.ones_like(param._local_tensor), mesh, [Replicate()], run_check=False)
    with on_local_shards(optimizer) as swapped:
        assert swapped is False and optimizer.param_groups[0]["params"][0] is param


def test_the_plugin_steps_on_local_shards_and_returns_the_closures_loss(mesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    seen = []
    step = optimizer.step

    def recording_step(**kwargs):
        seen.append(type(optimizer.param_groups[0]["params"][0]))
        return step(**kwargs)

    optimizer.step = recording_step  # type: ignore[method-assign]
    lightning_module = mock.MagicMock(automatic_optimization=False)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.randn(4, 6)).square().mean()
        loss.backward()
        return loss

    for plugin in (VitScalePrecision("bf16-mixed"), VitScalePrecision("32-true")):  # with and without the guard
        with mock.patch("lightning_vitscale.precision.plugin.after_closure"):
            loss = plugin.optimizer_step(optimizer, lightning_module, closure)
        assert isinstance(loss, torch.Tensor) and loss.requires_grad  # as `optimizer.step(closure)` under DDP
    assert seen == [torch.Tensor, torch.Tensor]
