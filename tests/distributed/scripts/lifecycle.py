"""Rank script: fit/validate/test/predict, all_gather, sync_dist and a meta-device model under VitScaleStrategy."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_vitscale import KernelPolicy, VitScaleStrategy
from lightning_vitscale.cli.demo import TinyViT, generated_images
from tests.helpers.attention_stand_in import substituted
from tests.helpers.models import Classifier, loader
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


class Gathering(Classifier):
    """Uses all_gather and sync_dist the way DDP users do."""

    def on_validation_epoch_end(self) -> None:
        gathered = self.all_gather(torch.tensor([float(self.global_rank)]))
        self.gathered = gathered.flatten().tolist()


def lifecycle() -> dict:
    """Every entry point under VitScaleStrategy, and the same under DDP as the oracle for the numbers."""
    return {"vitscale": _entry_points(VitScaleStrategy()), "ddp": _entry_points("ddp")}


def _entry_points(strategy) -> dict:
    L.seed_everything(0, verbose=False)
    model = Gathering("encoder")
    t = trainer(strategy=strategy, max_steps=4, limit_val_batches=2, num_sanity_val_steps=1)
    t.fit(model, loader(), loader(n=16))
    units_after_fit = t.strategy.plan.units if isinstance(strategy, VitScaleStrategy) else None
    logged_train_loss = float(t.callback_metrics["train_loss"])
    val = t.validate(model, loader(n=16), verbose=False)[0]
    test = t.test(model, loader(n=16), verbose=False)[0]
    preds = t.predict(model, loader(n=8), return_predictions=True)
    facts = {
        "val_loss": val["val_loss"],
        "test_acc": test["test_acc"],
        "preds": [p.tolist() for p in preds],
        "gathered": model.gathered,
        "logged_train_loss": logged_train_loss,
    }
    if isinstance(strategy, VitScaleStrategy):
        facts["params_are_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
        facts["units_after_reuse"] = t.strategy.plan.units
        facts["units_after_fit"] = units_after_fit
    return facts


class MetaInit(L.LightningModule):
    """Builds a model too large for one rank's budget on the meta device in configure_model."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        self.layers: nn.Module | None = None

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        with torch.device("meta"):
            self.layers = nn.Sequential(
                *[nn.Sequential(nn.Linear(self.width, self.width), nn.LayerNorm(self.width)) for _ in range(self.depth)]
            )

    def setup(self, stage: str) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # reset this process's peak RSS (VmHWM)
        self.rss_before = _rss_kib("VmRSS")

    def on_validation_start(self) -> None:
        self.peak_increase = (_rss_kib("VmHWM") - self.rss_before) * 1024

    def validation_step(self, batch, batch_idx):
        return self.layers(torch.ones(2, self.width)).sum()


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def meta_init() -> dict:
    width, depth = 2048, 32  # 32 x 4.2M params x 4 B = 537 MB unsharded
    model = MetaInit(width, depth)
    t = trainer(strategy=VitScaleStrategy(), limit_val_batches=1)
    t.validate(model, loader(n=4, batch_size=2), verbose=False)
    full = sum(p.numel() * 4 for p in model.parameters())
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {
        "full_bytes": full,
        "local_bytes": local,
        "peak_increase": model.peak_increase,
        "materialized": not any(p.is_meta for p in model.parameters()),
        "finite": all(torch.isfinite(p.to_local()).all().item() for p in model.parameters()),
    }


def attention_auto() -> dict:
    """attention="auto" with opposite local verdicts: rank 0 times the stand-in faster, rank 1 slower."""
    rank = int(os.environ["RANK"])
    L.seed_everything(0, verbose=False)
    model = TinyViT(image=16, dim=32, depth=2)
    strategy = VitScaleStrategy(kernels=KernelPolicy(attention="auto"))
    t = trainer(strategy=strategy, max_steps=3, limit_val_batches=0)
    with substituted(sdpa_ms=2.0, stand_in_ms=1.0 if rank == 0 else 5.0) as backend:
        t.fit(model, DataLoader(generated_images(48, image=16), batch_size=8))
    return {"line": t.strategy.plan.kernels["attention"], "stand_in_calls": backend.fn.calls}


SCENARIOS = {"lifecycle": lifecycle, "meta_init": meta_init, "attention_auto": attention_auto}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
