"""User code writing to parameters during ``fit`` on one device (``parameter_writes.py``): a momentum encoder
updated by lightly's ``.data =`` or DINO's in-place ``.data.mul_``, before, between or after the forwards of
``training_step`` or in ``on_train_batch_end``, trains with the plain Trainer's losses and teacher, bit for bit, on
the compute-copies path (the default) and on FSDP2's (``priority="memory"``). Before, a write in ``training_step``
landed on the step's copies: lost or a step late; after a forward, autograd raised "modified by an inplace
operation" (the copies shared one version counter)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.sharding.parameter_writes import ParameterWriteError
from tests.helpers.momentum import fit_momentum, teacher_state

CASES = [("lightly", "start"), ("lightly", "end"), ("lightly", "batch_end"), ("dino", "between"), ("dino", "end")]


@pytest.mark.parametrize("priority", ["speed", "memory"])
@pytest.mark.parametrize(("update", "where"), CASES)
def test_a_momentum_encoder_updated_by_user_code_trains_as_on_the_plain_trainer(update, where, priority):
    plain = fit_momentum("auto", update, where, devices=1)
    ours = fit_momentum(VitScaleStrategy(priority=priority), update, where, devices=1)
    assert ours.losses == plain.losses
    expected = teacher_state(plain)
    got = teacher_state(ours)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_a_data_assignment_on_a_sharded_parameter_writes_its_shard():
    """Outside a step the parameters are DTensors: ``p.data = v`` writes ``v`` into the shard the optimizer steps
    (torch's own setter rebinds the wrapper only, and every read still gives the old values)."""
    model = fit_momentum(VitScaleStrategy(priority="memory"), "lightly", "batch_end", devices=1, steps=1)
    weight = model.teacher.head.weight
    assert isinstance(weight, DTensor)
    weight.data = torch.full(weight.shape, 0.25)
    assert torch.equal(weight.full_tensor(), torch.full(weight.shape, 0.25))
    with pytest.raises(ParameterWriteError, match="shape"):
        weight.data = torch.zeros(3)


def test_bf16_writes_in_training_step_are_refused_naming_where_they_keep_fp32():
    """bf16-mixed computes on bf16 copies: a write there, carried back, would round the fp32 teacher each step; the
    same update in ``on_train_batch_end`` (the fp32 parameters) trains within bf16's resolution of AMP's."""
    with pytest.raises(ParameterWriteError, match="on_train_batch_end"):
        fit_momentum(VitScaleStrategy(), "lightly", "start", devices=1, precision="bf16-mixed", steps=1)
    plain = fit_momentum("auto", "lightly", "batch_end", devices=1, precision="bf16-mixed")
    ours = fit_momentum(VitScaleStrategy(), "lightly", "batch_end", devices=1, precision="bf16-mixed")
    assert ours.losses == pytest.approx(plain.losses, rel=2e-2)
    for name, value in teacher_state(plain).items():
        assert teacher_state(ours)[name].float() == pytest.approx(value.float(), abs=2e-2), name
