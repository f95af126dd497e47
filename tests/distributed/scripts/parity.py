"""Rank script: train each backbone under DDP and VitScaleStrategy with identical seeds and data; dump facts."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale import VitScaleStrategy, measure_state_bytes
from lightning_vitscale._compat import REDUCE_SCATTER
from tests.helpers.models import Classifier, loader
from tests.helpers.recording import count_collectives

warnings.filterwarnings("ignore")

BLOCK_CLASSES = {"encoder": "TransformerEncoderLayer", "timm": "Block", "hf": "ViTLayer", "resnet": "ResidualBlock"}
CONFIGS = {
    "plain": {},
    "accum_clip": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    "multicrop": {},
    "selective_accum4": {"accumulate_grad_batches": 4},
    "grouped_accum_clip": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
}
# Strategy settings per config (DDP takes none; the others run VitScaleStrategy() as it comes, speed first):
# "plain" the recipe's memory-first plan (every block its own unit, checkpointed); selective checkpointing with 4
# micro-batches per optimizer step, "auto" accumulation (ample host memory: one reduce-scatter per unit per
# optimizer step is expected); two consecutive blocks per FSDP unit (4 blocks: 2 block units + the outer one),
# every block checkpointed.
STRATEGY = {"plain": {"priority": "memory"}, "selective_accum4": {"activation_checkpointing": "selective"},
            "grouped_accum_clip": {"blocks_per_unit": 2, "activation_checkpointing": True}}


@contextmanager
def counting_reduce_scatters() -> Iterator[Counter[str]]:
    """Counts FSDP2's reduce-scatters while active: ``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` on
    torch 2.11) and, on CPU ranks, the all-to-all that ``sharding/cpu_overlap.py`` reduce-scatters with."""
    with count_collectives() as counts:
        totals: Counter[str] = Counter()
        yield totals
        totals["reduce_scatter"] = counts[REDUCE_SCATTER] + counts["all_to_all_single"]


def ddp_fit(config: str) -> tuple:
    """What a DDP run of ``config`` depends on: the Trainer's settings and the number of crops."""
    return sorted(CONFIGS[config].items()), config == "multicrop"


def run(backbone: str, config: str, strategy: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier(backbone, crops=2 if config == "multicrop" else 1)
    strat = VitScaleStrategy(**STRATEGY.get(config, {})) if strategy == "vitscale" else "ddp"
    # 4 optimizer steps: the first (optimizer state created), AdamW on its state, StepLR's halving after step 3;
    # 8 steps (twice the step time) checked nothing more.
    steps = 4
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strat, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, **CONFIGS[config],
    )
    per_step = CONFIGS[config].get("accumulate_grad_batches", 1)
    with counting_reduce_scatters() as counts:
        trainer.fit(model, loader(n=4 * 2 * steps * per_step))
    state = measure_state_bytes(model, trainer.optimizers)
    facts = {"losses": model.losses, "sharded_fraction": state.sharded_fraction,
             "reduce_scatters": counts["reduce_scatter"], "optimizer_steps": trainer.global_step}
    if strategy == "vitscale":
        # The modules themselves, found by class (FSDP2 subclasses them), not the plan's account of them.
        blocks = [m for m in model.modules() if BLOCK_CLASSES[backbone] in {c.__name__ for c in type(m).__mro__}]
        x = next(iter(loader(n=4)))[0]
        facts.update(
            num_blocks=len(blocks),
            fsdp_blocks=sum(isinstance(b, FSDPModule) for b in blocks),
            recomputed_blocks=count_recomputed(trainer.strategy.model, blocks, x),
            root_fsdp=isinstance(trainer.strategy.model, FSDPModule),
            units=trainer.strategy.plan.units,
            selective=len(trainer.strategy.plan.selective),
            accumulation=trainer.strategy.plan.accumulation,
            overlap=trainer.strategy.plan.overlap,
        )
    return facts


def count_recomputed(root: torch.nn.Module, blocks: list[torch.nn.Module], x: torch.Tensor) -> int:
    """Blocks whose layers run again in backward: activation checkpointing recomputes the block's forward.

    A forward hook on each block's first layer with parameters counts its calls in forward, then in backward;
    a checkpointed block's layer runs once in each, a stored-activation block's never in backward.
    """
    calls: Counter[int] = Counter()
    handles = []
    for i, block in enumerate(blocks):
        layer = next(m for m in block.modules() if any(True for _ in m.parameters(recurse=False)))
        handles.append(layer.register_forward_hook(lambda *_, i=i: calls.update([i])))
    out = root(x)
    in_forward = Counter(calls)
    calls.clear()
    out.sum().backward()
    for handle in handles:
        handle.remove()
    return sum(1 for i in range(len(blocks)) if in_forward[i] > 0 and calls[i] == in_forward[i])


def main() -> None:
    out, backbones, configs = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
    # Optional: "backbone/config" pairs run on top of the full grid (a scenario for one backbone only).
    pairs = [(b, c) for b in backbones for c in configs]
    pairs += [tuple(pair.split("/")) for pair in sys.argv[4].split(",")] if len(sys.argv) > 4 else []
    torch.set_num_threads(1)
    results = {}
    for backbone, config in pairs:
        for strategy in ("ddp", "vitscale"):
            # DDP takes no strategy settings: a config that differs from another only in them (timm's
            # grouped_accum_clip from accum_clip) has that one's DDP run, the same fit.
            same = next((c for c in CONFIGS if ddp_fit(c) == ddp_fit(config) and f"{backbone}/{c}/ddp" in results),
                        None)
            if strategy == "ddp" and same is not None:
                results[f"{backbone}/{config}/ddp"] = results[f"{backbone}/{same}/ddp"]
                continue
            results[f"{backbone}/{config}/{strategy}"] = run(backbone, config, strategy)
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
