"""Rank script for sharding layouts on 2 "nodes" x 2 ranks: DDP parity, per-rank state, measured traffic,
fp32 norms, and checkpoints that move between hybrid and full sharding and between world sizes.

``hybrid.py OUT MODE``: ``nodes`` (4 ranks, torchrun per node), ``two`` / ``one`` (resume a hybrid checkpoint
under full sharding on 2 / 1 ranks), ``lightning`` (4 ranks, Lightning's launcher per node).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from lightning_vitscale import VitScaleStrategy, measure_state_bytes
from tests.helpers.models import Classifier, loader
from tests.helpers.recording import TrafficRecorder
from tests.helpers.state import snapshot

warnings.filterwarnings("ignore")
NODES, PER_NODE = 2, 2
CLIP = 0.05



class Resumable(Classifier):
    def on_train_start(self) -> None:
        self.restored = snapshot(self, self.trainer)


class TrafficProbe(L.Callback):
    """Bytes sent inside / across nodes in each training batch (forward, backward, clipping, optimizer step)."""

    def __init__(self) -> None:
        self.steps: list[list[float]] = []
        self._stack = contextlib.ExitStack()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._recorder = self._stack.enter_context(TrafficRecorder(PER_NODE).recording())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stack.close()
        self.steps.append([self._recorder.intra, self._recorder.inter])


def global_rank() -> int:
    """Known before the Trainer starts: torchrun sets RANK; Lightning's launcher NODE_RANK and LOCAL_RANK."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return int(os.environ.get("NODE_RANK", "0")) * PER_NODE + int(os.environ.get("LOCAL_RANK", "0"))


def strategy_for(name: str):
    return "ddp" if name == "ddp" else VitScaleStrategy(sharding=name)


def fit(name: str, steps: int, nodes: int = NODES, precision: str = "32-true", ckpt: Path | None = None,
        devices: int = PER_NODE):
    # Each rank builds different initial weights: training can match DDP only if every rank (on both mesh
    # dimensions) starts from rank 0's, as DDP does. Then the same seed everywhere for data and dropout.
    torch.manual_seed(global_rank() + 1)
    model, probe = Resumable("encoder"), TrafficProbe()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes,
        strategy=strategy_for(name), max_steps=steps, precision=precision, gradient_clip_val=CLIP,
        callbacks=[probe], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, loader(n=128), ckpt_path=str(ckpt) if ckpt else None)
    return model, trainer, probe


def layout_facts(model, trainer, probe) -> dict:
    plan = trainer.strategy.plan
    weight = model.get_submodule(plan.block_names[0]).linear1.weight
    return {
        "sharding": plan.layout.sharding,
        "planned": [plan.layout.traffic.intra_node, plan.layout.traffic.inter_node],
        "hybrid_planned": None if plan.layout.hybrid_traffic is None else plan.layout.hybrid_traffic.inter_node,
        "measured": probe.steps,
        "placements": [str(p) for p in weight.placements],
        "mesh": weight.device_mesh.mesh.tolist(),
        "summary": plan.summary(),
    }


def parity_and_save(out: Path) -> dict:
    results = {}
    for name in ("ddp", "full", "hybrid"):
        model, trainer, probe = fit(name, 8)
        facts = {"losses": model.losses, "fraction": measure_state_bytes(model, trainer.optimizers).sharded_fraction}
        if name != "ddp":
            facts.update(layout_facts(model, trainer, probe))
            trainer.save_checkpoint(out / f"{name}.ckpt")
            torch.save(snapshot(model, trainer), out / f"{name}-saved-rank{dist.get_rank()}.pt")
        results[name] = facts
    return results


def resume(name: str, ckpt: Path, out: Path, tag: str, nodes: int = NODES, devices: int = PER_NODE) -> dict:
    model, trainer, _ = fit(name, 9, nodes=nodes, ckpt=ckpt, devices=devices)  # restored state: at train start
    torch.save(model.restored, out / f"{tag}-restored-rank{trainer.global_rank}.pt")
    return {"global_step": trainer.global_step, "losses": model.losses}


def bf16_norms() -> dict:
    """fp32 norms under hybrid bf16-mixed: (Replicate, Replicate) params, equal on all 4 ranks after training."""
    model, trainer, probe = fit("hybrid", 3, precision="bf16-mixed")
    norm = model.backbone.norm.weight
    local = norm.to_local().detach()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    facts = layout_facts(model, trainer, probe)
    facts.update(
        norm_placements=[str(p) for p in norm.placements],
        norm_dtype=str(local.dtype),
        norms_equal_on_all_ranks=all(torch.equal(g, gathered[0]) for g in gathered),
        norm_moved=not torch.equal(local, torch.ones_like(local)),
        losses=model.losses,
    )
    return facts


def nodes(out: Path) -> dict:
    results = parity_and_save(out)
    results["full_to_hybrid"] = resume("hybrid", out / "full.ckpt", out, "full_to_hybrid")
    results["bf16"] = bf16_norms()
    return results


def lightning_nodes(out: Path) -> dict:
    results = {}
    for name in ("full", "hybrid"):
        model, trainer, probe = fit(name, 4)
        results[name] = {"losses": model.losses, "cluster": type(trainer.strategy.cluster_environment).__name__}
        results[name].update(layout_facts(model, trainer, probe))
    return results


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    if mode == "nodes":
        results = nodes(out)
    elif mode == "lightning":
        results = lightning_nodes(out)
    else:  # hybrid checkpoint written by 4 ranks, resumed under full sharding on 2 or 1 rank(s)
        # "one" is a plain process (Lightning's launcher, devices=1): it once took devices from WORLD_SIZE's
        # default of 4, so Lightning's launcher started 3 more ranks and the "1 rank" resume ran on 4.
        world = 2 if mode == "two" else 1
        results = resume("full", out / "hybrid.ckpt", out, f"hybrid_to_full_{world}", nodes=1, devices=world)
    (out / f"{mode}-rank{dist.get_rank() if dist.is_initialized() else 0}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
