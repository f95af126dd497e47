"""Values of ``state_dict()`` changed in place reach the model, as DDP's shared storage has it
(``checkpoint/state_dict_writes.py``): timm's ``ModelEmaV3`` made in ``__init__`` (sharded with the model) and updated
through ``ema.state_dict()``, against the same module under DDP; 2 ranks: ``tests/distributed/test_dropin.py``."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.checkpoint import state_dict_writes
from tests.helpers.collective_habits import WithEma
from tests.helpers.tiny_vit_module import TinyViTModule
from tests.helpers.zoo import FunctionalAttention, hand_written


def fit(model: L.LightningModule, strategy, max_steps: int = 4) -> None:
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)


def whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


@pytest.mark.parametrize("priority", ["speed", "memory"])
def test_timm_s_ema_made_in_init_moves_as_under_ddp(priority):
    """Before: the EMA's shards never moved (its update wrote gathered copies): after 4 steps it held the first
    weights. Mutation seen failing: copies not remembered."""
    ddp, ours = WithEma("timm"), WithEma("timm")
    fit(ddp, "ddp")
    fit(ours, VitScaleStrategy(priority=priority))
    assert ours.losses == ddp.losses
    expected, got = ddp.ema.state_dict(), whole(ours.ema.state_dict())
    first = hand_written(FunctionalAttention).state_dict()  # seed 0: the weights the EMA started from
    assert any(not torch.equal(expected[f"module.{k}"], v) for k, v in first.items())  # it moved under DDP
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_a_copy_changed_after_the_run_is_not_written():
    """After the run (its teardown) nothing is remembered: a copy changed then leaves the model as it was, and no
    host copy outlives the run. Mutation seen failing: copies remembered outside a run."""
    model = WithEma("none")
    fit(model, VitScaleStrategy(), max_steps=1)
    state = model.net.state_dict()
    before = whole(model.net.state_dict())
    state["head.weight"].add_(1.0)  # after teardown: not remembered
    assert state_dict_writes.write_back() == 0
    assert torch.equal(whole(model.net.state_dict())["head.weight"], before["head.weight"])


class FromOutside(TinyViTModule):
    """A module whose step reads ``state_dict()`` and writes into it before its forward: the write reaches the
    weights the forward uses, as under DDP."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.net.state_dict()["head.bias"].fill_(float(batch_idx))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("priority", ["speed", "memory"])
def test_a_write_into_state_dict_values_in_the_step_reaches_its_forward(priority):
    """``memory``: the write goes to a gathered copy, written into the shard at the forward (mutation seen failing:
    copies not remembered). ``speed`` (one rank's compute copies): inside the step ``state_dict()`` returns the
    copies the forward uses, so the write lands there without this module; kept as the plan a user gets."""
    ddp, ours = FromOutside(), FromOutside()
    fit(ddp, "ddp")
    fit(ours, VitScaleStrategy(priority=priority))
    assert ours.losses == pytest.approx(ddp.losses, rel=1e-6)


def test_a_plain_copy_made_after_setup_and_updated_from_the_shards_fails_naming_the_fix():
    """Torch's ``AveragedModel`` made in ``on_fit_start`` (after the strategy sharded the model) is a plain copy; its
    ``update_parameters`` meets the shards: torch's "got mixed torch.Tensor and DTensor", with the fix noted."""
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor") as raised:
        fit(WithEma("averaged_after_setup"), VitScaleStrategy(), max_steps=2)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "`__init__` or `setup()`" in notes and "EMAWeightAveraging" in notes
