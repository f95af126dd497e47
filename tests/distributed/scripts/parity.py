"""Rank script: train each backbone under DDP and VitScaleStrategy with identical seeds and data; dump facts."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch

from lightning_vitscale import VitScaleStrategy, measure_state_bytes
from lightning_vitscale._compat import FSDPModule
from tests.helpers.models import Classifier, loader

warnings.filterwarnings("ignore")

CONFIGS = {
    "plain": {},
    "accum_clip": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    "multicrop": {},
}


def run(backbone: str, config: str, strategy: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier(backbone, crops=2 if config == "multicrop" else 1)
    strat = VitScaleStrategy() if strategy == "vitscale" else "ddp"
    steps = 8
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strat, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, **CONFIGS[config],
    )
    per_step = CONFIGS[config].get("accumulate_grad_batches", 1)
    trainer.fit(model, loader(n=4 * 2 * steps * per_step))
    state = measure_state_bytes(model, trainer.optimizers)
    facts = {"losses": model.losses, "sharded_fraction": state.sharded_fraction}
    if strategy == "vitscale":
        plan = trainer.strategy.plan
        blocks = [model.get_submodule(name) for name in plan.block_names]
        facts.update(
            blocks=plan.blocks,
            units=plan.units,
            all_blocks_fsdp=all(isinstance(b, FSDPModule) for b in blocks),
            num_blocks=len(blocks),
            checkpointed=len(plan.checkpointed),
            root_fsdp=isinstance(trainer.strategy.model, FSDPModule),
        )
    return facts


def main() -> None:
    out, backbones, configs = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
    torch.set_num_threads(1)
    results = {}
    for backbone in backbones:
        for config in configs:
            for strategy in ("ddp", "vitscale"):
                results[f"{backbone}/{config}/{strategy}"] = run(backbone, config, strategy)
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
