"""Step time through ``Trainer.fit`` on 2 CPU ranks, DDP against ``VitScaleStrategy()``, for published models whose
blocks the step calls in another order than the model lists them (units follow the step's calls since 51bdaa6):
HF's PoolFormer-S12 (each stage's patch embedding in one ``ModuleList``, its layers in another) and timm's
Twins-SVT-S (position convolutions between the blocks), random init, 64 px, batch 8 per rank, AdamW, fp32.

Run it from two checkouts, alternating, for a before/after (the package is imported from ``PYTHONPATH``)::

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> torchrun --nproc-per-node=2 benchmarks/out_of_order_units_speed.py \
        --rounds 2 --json out.json

Each round fits each model under both strategies (their order alternating between rounds); a fit's steps after
``--warmup`` are timed from ``on_train_batch_start`` to ``on_train_batch_end``; per fit the median of the slowest
rank's steps, and the FSDP units the default made.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy


def hf_poolformer_s12() -> nn.Module:
    import transformers

    return transformers.PoolFormerForImageClassification(transformers.PoolFormerConfig(num_labels=10))


def timm_twins_svt_small() -> nn.Module:
    import timm

    return timm.create_model("twins_svt_small", num_classes=10, img_size=64)


MODELS = {"hf_poolformer_s12": hf_poolformer_s12, "timm_twins_svt_small": timm_twins_svt_small}


class Timed(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MODELS[name]()
        self.times: list[float] = []
        self._start = 0.0

    def training_step(self, batch, batch_idx):
        images, labels = batch
        out = self.net(images)
        return F.cross_entropy(out if isinstance(out, torch.Tensor) else out.logits, labels)

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(name: str, variant: str, steps: int, warmup: int) -> tuple[float, int]:
    """The median step (ms, slowest rank) and the FSDP units made (0 for DDP)."""
    g = torch.Generator().manual_seed(0)
    n = 8 * 2 * steps
    data = TensorDataset(torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    model = Timed(name)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp" if variant == "ddp" else VitScaleStrategy(),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
    slowest = trainer.strategy.reduce(torch.tensor(model.times[warmup:]), reduce_op="max")
    return statistics.median(slowest.tolist()) * 1000, 0 if variant == "ddp" else trainer.strategy.plan.units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the numbers here (rank 0)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    found: dict = {}
    for round_index in range(args.rounds):
        for name in MODELS:
            for variant in ("ddp", "default") if round_index % 2 == 0 else ("default", "ddp"):
                ms, units = fit(name, variant, args.steps, args.warmup)
                entry = found.setdefault(name, {}).setdefault(variant, {"ms": [], "units": units})
                entry["ms"].append(round(ms, 2))
    if int(os.environ.get("RANK", "0")) == 0:
        for name, variants in found.items():
            ratios = [a / b for a, b in zip(variants["default"]["ms"], variants["ddp"]["ms"])]
            print(f"{name}: default {variants['default']['ms']} ms ({variants['default']['units']} units), "
                  f"ddp {variants['ddp']['ms']} ms, ratio per round {[round(r, 3) for r in ratios]}")
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"torch": torch.__version__, "lightning": L.__version__, "models": found}, file, indent=1)


if __name__ == "__main__":
    main()
