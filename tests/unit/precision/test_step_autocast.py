"""Under the mixed flags a step's own code computes as under DDP's AMP, inside ``torch.autocast``, and the model's
blocks and layers as O2, with autocast off (``precision/step_autocast.py``); one device, both plans (one rank's
compute copies, and FSDP2's units under ``priority="memory"``). 2 ranks against DDP: the ``-bf16`` cases of
``tests/distributed/test_user_code_on_parameters.py``."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_vitscale import VitScaleStrategy
from tests.helpers.momentum import images
from tests.helpers.penalties import fit_penalty
from tests.helpers.tiny_vit_module import TinyViTModule
from tests.helpers.zoo import PatchClassifier


class Recorded(TinyViTModule):
    """Where autocast is on: in the step, in the model (``net``: a layer holding the position embedding), in a
    block, in the head; and the step's loss against the one computed from fp32 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list[bool]] = {"step": [], "validation": [], "net": [], "block": [], "head": []}
        self.losses: list[tuple[torch.dtype, float, float]] = []
        for name, module in (("net", self.net), ("block", self.net.layers[0]), ("head", self.net.head)):
            module.register_forward_pre_hook(lambda _, __, name=name: self.seen[name].append(on()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen["step"].append(on())
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.losses.append((loss.dtype, loss.item(), F.cross_entropy(logits.float(), y).item()))
        return loss

    def validation_step(self, batch, batch_idx):
        self.seen["validation"].append(on())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(images(8), batch_size=4)  # an epoch of 2 steps: a validation after them

    def val_dataloader(self):
        return torch.utils.data.DataLoader(images(4), batch_size=4)


def on() -> bool:
    return torch.is_autocast_enabled("cpu")


def fit(precision: str, priority: str) -> Recorded:
    model = Recorded()
    L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(priority=priority), precision=precision,
              max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0).fit(model)
    return model


@pytest.mark.parametrize("priority", ["speed", "memory"])
def test_the_step_computes_as_under_amp_and_the_model_as_o2(priority):
    """Mutations seen failing: the layers' hooks not registered (autocast on in the block), the plugin's autocast
    removed (the loss in bf16, a multiple of 1/64)."""
    model = fit("bf16-mixed", priority)
    assert model.seen["step"] == [True, True] and model.seen["validation"] == [True]
    for name in ("net", "block", "head"):  # the two steps (setup's runs of the step record into the planner's copy)
        assert len(model.seen[name]) == 2 and not any(model.seen[name]), name
    for dtype, loss, from_fp32_logits in model.losses:
        assert dtype == torch.float32 and loss == from_fp32_logits  # DDP's AMP computes the loss in fp32 as well
    x = images(2).tensors[0]
    model.net(x)  # after fit, outside any step: no autocast, as under DDP
    assert not on() and model.seen["net"][-1] is False


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_flags_without_autocast_under_ddp_run_none(precision):
    model = fit(precision, "speed")
    assert model.seen["step"] == [False, False] and model.seen["block"] == [False, False]


def test_fp32_data_against_a_block_weight_in_the_step_computes_as_under_amp():
    """A block weight applied to the fp32 batch after the forward, where the default plan keeps the block gathered in
    bf16: before, torch's "expected m1 and m2 to have the same dtype"; now bf16 under autocast, as DDP's AMP."""
    ours, ddp = fit_penalty("data-after-bf16", VitScaleStrategy()), fit_penalty("data-after-bf16", "ddp")
    assert len(ours.losses) == len(ddp.losses) == 4
    assert ours.losses == pytest.approx(ddp.losses, rel=2e-3)  # O2 against DDP's AMP (measured: 1.4e-4)


def test_the_step_s_autocast_device_is_the_one_lightning_s_flag_names():
    """``Trainer(precision="bf16-mixed")`` builds ``MixedPrecision(device=...)`` from the accelerator; ours keeps it
    (a CUDA machine training on ``accelerator="cpu"`` autocasts the CPU, as DDP's step does)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_vitscale.precision import VitScalePrecision, to_vitscale_precision

    assert to_vitscale_precision(MixedPrecision("bf16-mixed", device="cuda")).device == "cuda"
    assert to_vitscale_precision(MixedPrecision("bf16-mixed", device="cpu")).device == "cpu"
    assert VitScalePrecision("bf16-mixed", device="cuda").device == "cuda"


class LossInForward(PatchClassifier):
    """A model computing its own loss, as HF's ``labels=`` does (inside a module holding a parameter: O2's side)."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(images), labels)


class LossInModel(TinyViTModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = LossInForward(32, self.net.layers)
        self.dtypes: list[torch.dtype] = []

    def training_step(self, batch, batch_idx):
        loss = self.net(*batch)
        self.dtypes.append(loss.dtype)
        return loss


def test_a_loss_the_model_computes_in_its_forward_is_fp32_as_under_amp():
    """Mutation seen failing: torch's losses run under autocast only where a call mixes dtypes (bf16)."""
    model = LossInModel()
    L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(), precision="bf16-mixed", max_steps=2,
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(model)
    assert model.dtypes == [torch.float32] * 2
