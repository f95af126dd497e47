"""A trainable parameter the step never uses (DINOv2's or BEiT's mask token in a classifier) has no optimizer state
when the checkpoint is saved, as under DDP; a fit resumes from that checkpoint as DDP's does, every state entry as
saved (DCP's strict load asked for the parameter's state and refused to resume: found running HF DINOv2)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, loader
from tests.helpers.state import snapshot


class WithMaskToken(Classifier):
    def __init__(self) -> None:
        super().__init__("encoder")
        self.mask_token = torch.nn.Parameter(torch.zeros(1, 8))  # used only when masking, never here

    def on_train_start(self) -> None:
        self.restored = snapshot(self, self.trainer)


class AtEnd(Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = snapshot(pl_module, trainer)


def fit(steps: int, ckpt_path=None, callbacks=()) -> tuple[WithMaskToken, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = WithMaskToken()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(), max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(n=32), ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_a_parameter_without_optimizer_state_resumes_as_under_ddp(tmp_path, mesh, layout):
    at_end = AtEnd()
    _, trainer = fit(4, callbacks=(at_end,))
    trainer.strategy.state_dict_type = layout
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    assert not any(key.startswith("o.mask_token.") for key in at_end.state)  # never had a gradient
    resumed, trainer = fit(8, ckpt_path=tmp_path / "saved.ckpt")
    assert all(torch.equal(resumed.restored[key], value) for key, value in at_end.state.items())  # nothing lost
    assert trainer.global_step == 8 and len(resumed.losses) == 4
    extra = {key: value for key, value in resumed.restored.items() if key not in at_end.state}
    if layout == "sharded":
        assert extra == {}  # the mask token again without state, as under DDP
    else:  # torch's full-state load leaves it the zero state it made to load into: never read without a gradient
        assert extra.keys() == {"o.mask_token.step", "o.mask_token.exp_avg", "o.mask_token.exp_avg_sq"}
        assert not extra["o.mask_token.exp_avg"].any() and not extra["o.mask_token.exp_avg_sq"].any()
