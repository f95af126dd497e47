"""On one device every optimizer a DDP user brings trains as under DDP, checkpoints included: each local tensor is a
whole parameter there, so any optimizer (not only the elementwise ones) steps the local tensors, where DTensor has
no rule for some (torch's Adafactor, its factored rows and columns; Rprop's masked writes). Several ranks:
``tests/distributed/test_precision.py`` (elementwise and DTensor-aware ones train, the others are refused at setup).

Found 2026-12-04 trying the optimizers users bring: on one device torch's Adafactor failed at its first step with
DTensor's "in-place operations that require placement changes are not supported", and its checkpoint's save and
resume (torch DCP steps a fresh optimizer once) the same. Mutations seen failing: ``steps_locally`` without the
one-rank case (Adafactor raises at the first step), ``init_state_locally`` returning at once (the resume raises).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.helpers.models import Classifier, loader

pytestmark = pytest.mark.timeout(300)

OPTIMIZERS = {
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "muon": lambda params: torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02),
}


class WithOptimizer(Classifier):
    def __init__(self, optimizer: str) -> None:
        super().__init__("timm")
        self.optimizer = optimizer

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())


def fit(strategy, optimizer: str, steps: int, root, ckpt_path=None) -> tuple[list[float], L.Trainer]:
    torch.manual_seed(0)
    model = WithOptimizer(optimizer)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        default_root_dir=root, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader(40, batch_size=4), ckpt_path=ckpt_path)
    return model.losses, trainer


def vitscale():
    from lightning_vitscale import VitScaleStrategy

    return VitScaleStrategy()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_non_elementwise_optimizer_trains_on_one_device_as_under_ddp(optimizer, tmp_path):
    ours, _ = fit(vitscale(), optimizer, 3, tmp_path)
    assert ours == pytest.approx(fit("ddp", optimizer, 3, tmp_path)[0], rel=1e-6, abs=1e-6)


def test_adafactor_saved_and_resumed_on_one_device_continues_as_ddps(tmp_path):
    """A mid-run save and a resume (the epoch restarts: its loader is not stateful) against DDP doing the same."""
    resumed = {}
    for name, make in (("ddp", lambda: "ddp"), ("vitscale", vitscale)):
        first, trainer = fit(make(), "adafactor", 3, tmp_path / name)
        trainer.save_checkpoint(tmp_path / name / "mid.ckpt")
        rest, _ = fit(make(), "adafactor", 6, tmp_path / name, ckpt_path=tmp_path / name / "mid.ckpt")
        resumed[name] = first + rest
    assert len(resumed["vitscale"]) == 6
    assert resumed["vitscale"] == pytest.approx(resumed["ddp"], rel=1e-5, abs=1e-6)
