"""User code writing to parameters during ``fit`` on one device (``parameter_writes.py``): a momentum encoder
updated by lightly's ``.data =`` or DINO's in-place ``.data.mul_``, before, between or after the forwards of
``training_step`` or in ``on_train_batch_end``, trains with the plain Trainer's losses and teacher, bit for bit, on
the compute-copies path (the default) and on FSDP2's (``priority="memory"``). Before, a write in ``training_step``
landed on the step's copies: lost or a step late; after a forward, autograd raised "modified by an inplace
operation" (the copies shared one version counter)."""

from __future__ import annotations

import lightning as L
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


class ForcedNormBlock(torch.nn.Module):
    """EDM2's magnitude-preserving layer (``MPConv.forward``): each training forward writes its weight normalized
    back to the parameter in place ("forced weight normalization"), then computes on the normalized weight."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, dim))
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(torch.float32)
        if self.training:
            with torch.no_grad():
                self.weight.copy_(torch.nn.functional.normalize(w, dim=1))
        w = torch.nn.functional.normalize(w, dim=1)
        return x + self.out(torch.nn.functional.gelu(x @ w.to(x.dtype).T))


class ForcedNormModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*(ForcedNormBlock() for _ in range(3)))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.blocks(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        data = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


def _fit_forced_norm(strategy, precision: str = "32-true") -> ForcedNormModel:
    model = ForcedNormModel()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=3, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
    return model


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("options", [{}, {"priority": "memory", "activation_checkpointing": False},
                                     {"priority": "memory"}], ids=["speed", "memory-unchecked", "memory"])
def test_a_write_a_block_makes_to_its_own_weight_in_forward_reaches_the_weight(options):
    """EDM2's forced weight normalization trains as under DDP (one device: the same distributed sampler's batches),
    bit for bit. Before, under ``priority="memory"`` (each block a unit resharded after its forward) the write landed
    on the gathered copy and was dropped with it: the rows never normalized (norms 4.6 where DDP's are 8.0 on 2
    ranks), losses apart from the second step. With every block checkpointed (``memory``'s default) the recompute
    writes again and normalizes the normalized weight (a parameter's values before a forward are not kept, unlike a
    buffer's: the cost of a copy of every block's weights per step): DDP's losses, weights within a few float32
    rounding steps (normalizing twice is idempotent but for rounding: 1.2e-7 at 0.6, 2 ulps, on an AVX-512 EPYC).
    Mutation seen failing: without the carry as a unit's forward ends (both ``memory`` cases)."""
    plain, ours = _fit_forced_norm("ddp"), _fit_forced_norm(VitScaleStrategy(**options))
    assert ours.losses == plain.losses
    for name, value in plain.state_dict().items():
        if options.get("activation_checkpointing", True) is False or not options:
            assert torch.equal(_whole(ours.state_dict()[name]), value), name
        else:
            torch.testing.assert_close(_whole(ours.state_dict()[name]), value, rtol=5e-7, atol=1e-7)


@pytest.mark.filterwarnings("ignore")
def test_a_bf16_write_in_a_forward_is_refused_naming_the_module():
    with pytest.raises(ParameterWriteError, match="the forward of `blocks.0` wrote to `blocks.0.weight`"):
        _fit_forced_norm(VitScaleStrategy(priority="memory"), precision="bf16-mixed")
