"""Layers whose own code needs fp32 weights under O2 (GFNet's global filter takes ``torch.view_as_complex`` of its
weight, FourCastNet's AFNO multiplies its fp32 spectrum by its weights): DDP's AMP keeps every weight in fp32, O2
handed them bf16 and the first step raised. Setup keeps such a layer in fp32 from the step it runs on a batch
(``memory/low_precision_failures.py``); where it runs none, the first step's error names the fix
(``precision/fp32_fix.py``). One device here; the same on 2 ranks in ``tests/distributed/test_zoo.py``."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_vitscale import VitScalePrecision, VitScaleStrategy
from tests.helpers.results import max_relative_difference
from tests.helpers.zoo import CLASSES, FOURIER, IMAGE

FILTERS = ("backbone.layers.0.filter", "backbone.layers.1.filter")


class FourierNet(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = FOURIER[kind]()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.backbone(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(12, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (12,), generator=g))


class _Stream(IterableDataset):
    """Samples a setup cannot read ahead (an iterable may be consumed by reading it)."""

    def __iter__(self):
        return iter(_data())


def _fit(kind: str, strategy, precision: str, plugins=(), stream: bool = False) -> tuple[list[float], L.Trainer]:
    model = FourierNet(kind)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=None if plugins else precision,
                        plugins=list(plugins), max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(_Stream() if stream else _data(), batch_size=4))
    return model.losses, trainer


@pytest.mark.parametrize("kind", FOURIER)
def test_a_layer_raising_on_its_bf16_weights_is_kept_in_fp32_and_trains_as_ddps_amp(kind):
    """bf16-mixed: DDP's AMP losses within 0.1% (5e-4 here), the summary naming each layer kept and torch's error.
    fp32: DDP's losses bit for bit, nothing kept. Mutation seen failing: no module kept (the fit raised torch's
    error)."""
    amp = _fit(kind, "ddp", "bf16-mixed")[0]
    ours, trainer = _fit(kind, VitScaleStrategy(), "bf16-mixed")
    assert len(amp) == 3 and max_relative_difference(ours, amp) < 1e-3
    summary = trainer.strategy.plan.summary()
    assert "2 module(s) whose own code raised with their weights in bfloat16 kept in fp32" in summary, summary
    assert all(name in summary for name in FILTERS) and "through training_step" in summary
    fp32, trainer = _fit(kind, VitScaleStrategy(), "32-true")
    assert fp32 == _fit(kind, "ddp", "32-true")[0]
    assert "whose own code raised" not in trainer.strategy.plan.summary()


def test_without_a_step_at_setup_the_first_steps_error_names_the_fix_and_the_fix_trains():
    """A stream setup cannot read ahead: the first step raises torch's error with the module and the fix noted;
    ``full_precision`` with the named modules then trains with DDP's AMP losses. Mutation seen failing: the note not
    added (``on_exception``)."""
    with pytest.raises(RuntimeError, match="view_as_complex") as raised:
        _fit("gfnet", VitScaleStrategy(), "bf16-mixed", stream=True)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert f"full_precision={{'{FILTERS[0]}'}}" in notes and "precision='bf16-mixed' (O2)" in notes, notes
    plugin = VitScalePrecision("bf16-mixed", full_precision=set(FILTERS))
    ours = _fit("gfnet", VitScaleStrategy(), "bf16-mixed", plugins=[plugin], stream=True)[0]
    amp = _fit("gfnet", "ddp", "bf16-mixed", stream=True)[0]
    assert len(amp) == 3 and max_relative_difference(ours, amp) < 1e-3


def test_the_same_layer_of_each_block_is_kept_never_every_layer_of_its_class():
    """One more run of the step keeps the failing layer of every block (``blocks.0.filter`` -> each block's
    ``filter``), never every module of its class: a failing ``nn.Linear`` would otherwise keep the whole model in
    fp32. Outside the blocks the module alone."""
    from torch import nn

    from lightning_vitscale.memory.low_precision_failures import _alike

    model = FOURIER["gfnet"]()
    blocks = ["layers.0", "layers.1"]
    assert _alike(model, "layers.0.filter", blocks) == ["layers.0.filter", "layers.1.filter"]
    assert _alike(model, "layers.1.mlp.0", blocks) == ["layers.0.mlp.0", "layers.1.mlp.0"]  # not the head
    assert isinstance(model.head, nn.Linear) and _alike(model, "head", blocks) == ["head"]
