"""Rank script: 0-dim parameters (``tests/helpers/contrastive.py``) on 2 ranks under DDP, ``VitScaleStrategy()`` and
``priority="memory"``, per scenario this rank's results:

- ``train/<strategy>``: 4 steps: losses, the temperature after each step's clamp, every 0-dim parameter's value;
- ``resume``: DDP saves its file at step 2, DDP and ``VitScaleStrategy()`` resume from it to step 4;
  ``VitScaleStrategy()`` saves its sharded folder at step 2 and resumes from it: the losses of steps 3-4 and the
  values after;
- ``averaged/<strategy>``: Lightning's ``WeightAveraging`` EMA, validation on the averaged weights every 2 steps.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import WeightAveraging

from lightning_vitscale import VitScaleStrategy
from tests.helpers.contrastive import TemperatureClip, fit, scalars
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
OUT = Path(sys.argv[1])
STRATEGIES = {"ddp": lambda: "ddp", "default": VitScaleStrategy, "memory": lambda: VitScaleStrategy(priority="memory")}


def train(strategy: str) -> dict:
    model = fit(STRATEGIES[strategy](), devices=2)
    return {"losses": model.losses, "temperatures": model.temperatures, "scalars": scalars(model)}


class Validated(TemperatureClip):
    def __init__(self) -> None:
        super().__init__()
        self.validation: list[float] = []

    def validation_step(self, batch, batch_idx):
        images, texts = batch
        labels = torch.arange(len(images))
        loss = F.cross_entropy(self.net(images, texts) + self.margin * torch.eye(len(images)), labels)
        self.validation.append(loss.item())
        return loss

    def val_dataloader(self):
        return self.train_dataloader()


def averaged(strategy: str) -> dict:
    """Lightning's ``WeightAveraging`` (an EMA), validated on the averaged weights every 2 steps."""
    model = Validated()
    ema = WeightAveraging(avg_fn=torch.optim.swa_utils.get_ema_avg_fn(0.9))
    L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[strategy](), max_steps=4, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[ema],
              val_check_interval=2, num_sanity_val_steps=0, limit_val_batches=2).fit(model)
    return {"losses": model.losses, "validation": model.validation, "scalars": scalars(model)}


def resume() -> dict:
    """Resumed by DDP from its file (the oracle: Lightning restarts a plain DataLoader's epoch on resume, so it is
    not the 4-step run), by ``VitScaleStrategy()`` from that file and from its own folder."""
    results = {}
    for saver in ("ddp", "default"):
        first = fit(STRATEGIES[saver](), steps=2, devices=2)
        path = OUT / f"{saver}-step2.ckpt"
        first.trainer.save_checkpoint(path)
        for resumer in ("ddp", "default") if saver == "ddp" else ("default",):
            model = fit(STRATEGIES[resumer](), steps=4, devices=2, ckpt_path=str(path))
            results[f"{saver}->{resumer}"] = {"losses": model.losses, "scalars": scalars(model)}
    return results


if __name__ == "__main__":
    run_scenarios({**{f"train/{name}": (lambda name=name: train(name)) for name in STRATEGIES}, "resume": resume,
                   "averaged/ddp": lambda: averaged("ddp"), "averaged/default": lambda: averaged("default")})
