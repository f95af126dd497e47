"""LBFGS on one device trains as under DDP, through Lightning's automatic closure and a manual ``opt.step(closure)``:
its step treats all parameters as one flat vector (``p.grad.view(-1)``, ``torch.cat``), which DTensor cannot
reshape, so it steps the local tensors (whole parameters on one rank: ``local_step.lbfgs_on_whole_locals``). Found
2026-12-06 trying the manual-optimization habits users bring: both failed at the first step with DTensor's "This
operation would remove or reshape sharded dimension 0". With a gradient scaler it is refused as DDP's AMP plugin
refuses it; on several ranks at setup (``tests/distributed/test_precision.py``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, loader

pytestmark = pytest.mark.timeout(300)


class WithLBFGS(Classifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


class ManualLBFGS(WithLBFGS):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch

        def closure():
            optimizer.zero_grad()
            loss = F.cross_entropy(self(x), y)
            self.manual_backward(loss)
            return loss

        self.losses.append(float(optimizer.step(closure=closure)))


def fit(module_class: type[L.LightningModule], strategy, precision: str = "32-true", steps: int = 3):
    torch.manual_seed(0)
    model = module_class()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, limit_val_batches=0).fit(model, loader(32, batch_size=4))
    return model


def whole(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("options", [{}, {"priority": "memory"}], ids=["default", "memory"])
@pytest.mark.parametrize("module_class", [WithLBFGS, ManualLBFGS], ids=["automatic", "manual"])
def test_lbfgs_trains_on_one_device_as_under_ddp(module_class, options):
    ours, ddp = fit(module_class, VitScaleStrategy(**options)), fit(module_class, "ddp")
    # LBFGS evaluates the closure up to max_iter times a step: the automatic module logs each evaluation's loss
    assert len(ddp.losses) >= 3 and len(set(ddp.losses)) > 1
    assert ours.losses == ddp.losses
    expected = whole(ddp)
    assert all(torch.equal(value, expected[name]) for name, value in whole(ours).items())
    assert all(isinstance(p, DTensor) and p.grad is None or isinstance(p.grad, DTensor) for p in ours.parameters())


def test_lbfgs_under_bf16_mixed_trains_as_under_ddps_amp():
    ours, ddp = fit(ManualLBFGS, VitScaleStrategy(), "bf16-mixed"), fit(ManualLBFGS, "ddp", "bf16-mixed")
    assert ours.losses[0] == pytest.approx(ddp.losses[0], rel=1e-2)  # O2's bf16 weights against autocast's
    assert ours.losses == pytest.approx(ddp.losses, rel=5e-2)


def test_lbfgs_with_a_gradient_scaler_is_refused_as_ddps_amp_refuses_it():
    """``"16-mixed"`` (fp16 with a scaler: GPU only for DDP, so the plugin is called here as Lightning would)."""
    from lightning_vitscale import VitScalePrecision

    plugin = VitScalePrecision("16-mixed")
    optimizer = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(MisconfigurationException, match="AMP and the LBFGS optimizer are not compatible"):
        plugin.optimizer_step(optimizer, model=None, closure=lambda: None)


class SaveAtStart(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)  # before LBFGS's first step: its state is empty


def fit_saving(strategy, root, steps: int, ckpt_path=None, callbacks=()) -> WithLBFGS:
    torch.manual_seed(0)
    model = WithLBFGS()
    saving = ckpt_path is None and not callbacks
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, default_root_dir=root,
              callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2)] if saving else list(callbacks),
              enable_checkpointing=saving, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, limit_val_batches=0).fit(model, loader(32, batch_size=4), ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("where", ["mid-run", "before the first step"])
def test_lbfgs_saved_and_resumed_on_one_device_continues_as_ddps(where, tmp_path):
    """Its state (flat vectors, history lists under its first parameter) is written as DCP writes it and read whole
    into ``optimizer.load_state_dict`` (``optimizer_state.keeps_flat_state``): torch DCP's optimizer state dict
    steps a fresh optimizer without the closure LBFGS needs ("'NoneType' object is not callable" at the resume, and
    at a save before the first step). The epoch restarts on resume (the loader is not stateful), under DDP too."""
    resumed, saved_by = {}, {}
    for name, strategy in (("ddp", lambda: "ddp"), ("ours", VitScaleStrategy)):
        root = tmp_path / name
        if where == "mid-run":
            fit_saving(strategy(), root, 2)
            (saved,) = root.glob("*.ckpt")
        else:
            saved = root / "start.ckpt"
            fit_saving(strategy(), root, 1, callbacks=[SaveAtStart(saved)])
        resumed[name], saved_by[name] = fit_saving(strategy(), root, 4, ckpt_path=saved), saved
    # DDP's own file (torch's format, one file) resumed by the strategy too
    resumed["ours from ddp's file"] = fit_saving(VitScaleStrategy(), tmp_path / "x", 4, ckpt_path=saved_by["ddp"])
    assert len(resumed["ddp"].losses) >= 2
    expected = whole(resumed["ddp"])
    for name in ("ours", "ours from ddp's file"):
        assert resumed[name].losses == resumed["ddp"].losses, name
        assert all(torch.equal(value, expected[key]) for key, value in whole(resumed[name]).items()), name
