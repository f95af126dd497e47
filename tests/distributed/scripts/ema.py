"""Rank script for ShardedEMA: DDP and VitScaleStrategy against a plain full-tensor EMA, save/resume across world
sizes, evaluation with the EMA weights, no collectives, local bytes, bf16-true master weights, export."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from lightning_vitscale import ShardedEMA, VitScaleStrategy
from lightning_vitscale._utils import full_bytes, local_bytes
from tests.helpers.models import IMAGE, Classifier, loader
from tests.helpers.recording import count_collectives

warnings.filterwarnings("ignore")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
DECAY = 0.9


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class PlainEMA(L.Callback):
    """The oracle: whole fp32 tensors, one parameter at a time, the formula written out (no shared code)."""

    def __init__(self) -> None:
        self.ema: dict[str, torch.Tensor] = {}
        self.updates, self.last_step = 0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last_step:
            return
        self.last_step = trainer.global_step
        weights = {n: full(p).float() for n, p in pl_module.named_parameters()}  # gathers: test code only
        if self.updates == 0:
            self.ema = weights
        else:
            d = min(DECAY, (1 + self.updates) / (10 + self.updates))
            self.ema = {n: d * self.ema[n] + (1 - d) * w for n, w in weights.items()}
        self.updates += 1

    def state_dict(self):
        return {"ema": self.ema, "updates": self.updates, "last_step": self.last_step}

    def load_state_dict(self, state):
        self.ema, self.updates, self.last_step = state["ema"], state["updates"], state["last_step"]


def counted(ema: ShardedEMA, totals: list[int]) -> ShardedEMA:
    """Counts every collective issued by the EMA update hook (torch.distributed calls and dispatched ops)."""
    hook = ema.on_train_batch_end

    def on_train_batch_end(*args, **kwargs):
        with count_collectives() as counts, CommDebugMode() as mode:
            hook(*args, **kwargs)
        totals.append(sum(counts.values()) + mode.get_total_counts())

    ema.on_train_batch_end = on_train_batch_end
    return ema


class SeesValidationEnd(Checkpoint):
    """Stands for ModelCheckpoint/EarlyStopping: records what it sees each time a validation ends."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_validation_end(self, trainer, pl_module):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if "val" in k})


class Snapshots(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.restored = ema_full(trainer)


def ema_of(trainer: L.Trainer) -> ShardedEMA:
    return next(c for c in trainer.callbacks if isinstance(c, ShardedEMA))


def ema_full(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return {n: full(t) for n, t in ema_of(trainer).shards.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys())[:5])
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def make_trainer(name: str, steps: int, callbacks: list, **kwargs) -> L.Trainer:
    strategy = VitScaleStrategy() if name == "vitscale" else "ddp"
    options = dict(num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=4, enable_checkpointing=False)
    options.update(kwargs)
    return L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, **options,
    )


def new_ema() -> ShardedEMA:
    return ShardedEMA(decay=DECAY, warmup=True)


def train_and_save(name: str, out: Path) -> dict:
    """4 steps with validation at step 4 (evaluate="both"), EMA vs the oracle, then a checkpoint."""
    L.seed_everything(0, verbose=False)
    model, plain, collectives, watcher = Classifier("encoder"), PlainEMA(), [], SeesValidationEnd()
    trainer = make_trainer(name, 4, [counted(new_ema(), collectives), plain, watcher], enable_checkpointing=True)
    trainer.fit(model, loader(n=128), loader(n=16, seed=1))
    ema = ema_of(trainer)
    facts = {
        "oracle_diff": max_diff(ema_full(trainer), plain.ema),
        "updates": ema.updates,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "update_collectives": collectives,
        "validation_end_seen": watcher.seen,
    }
    torch.save({k: v for k, v in plain.ema.items()}, out / f"{name}-plain-step4.pt")
    trainer.save_checkpoint(out / f"{name}-step4.ckpt")
    if name == "vitscale":  # the same state in DDP's one-file format: the EMA must be whole tensors in it
        trainer.strategy.state_dict_type = "full"
        trainer.save_checkpoint(out / "vitscale-full-step4.ckpt")
        trainer.strategy.state_dict_type = "sharded"
    torch.save(ema_full(trainer), out / f"{name}-ema-step4-rank{RANK}.pt")
    facts.update(swap_facts(trainer, model, ema))
    facts["memory"] = memory_facts(model, ema)
    facts["calls_around_swap"] = calls_around_swap(trainer, model, ema)  # last: leaves the outer unit gathered
    return facts


def swap_facts(trainer: L.Trainer, model: L.LightningModule, ema: ShardedEMA) -> dict:
    """Swapping in and out: no collective, the EMA inside, the raw weights back bit for bit."""
    before = {n: full(p) for n, p in model.named_parameters()}
    with count_collectives() as counts, CommDebugMode() as mode:
        with ema.averaged(trainer):
            inside = [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
    collectives = sum(counts.values()) + mode.get_total_counts()
    expected = [t for t in ema.shards.tensors()[: len(inside)]]
    after = {n: full(p) for n, p in model.named_parameters()}
    return {
        "swap_collectives": collectives,
        "swap_inside_is_ema": all(torch.equal(a, b) for a, b in zip(inside, expected)),
        "swap_restores_raw": max_diff(before, after) == 0.0,
    }


def calls_around_swap(trainer: L.Trainer, model: L.LightningModule, ema: ShardedEMA) -> list[list]:
    """The model called after ``fit`` with gradients enabled (its outer unit then stays gathered, as a backward
    may follow), then inside ``ema.averaged``, then after it: the outputs DDP gives. Nothing else reshards here,
    so a gathered outer unit would serve the raw weights inside the swap, or the EMA ones after it."""
    model.eval()  # no dropout: outputs comparable across strategies
    images = torch.randn(4, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(7))
    outputs = [model(images).detach()]
    with ema.averaged(trainer):
        outputs.append(model(images).detach())
    outputs.append(model(images).detach())
    model.train()
    return [o.tolist() for o in outputs]


def memory_facts(model: L.LightningModule, ema: ShardedEMA) -> dict:
    params = list(model.parameters())
    ema_state = list(ema.shards.state_dict().values())[: len(params)]
    return {
        "ema_local": local_bytes(ema.shards.tensors()[: len(params)]),
        "ema_state_local": local_bytes(ema_state),
        "ema_full": full_bytes(ema_state),
        "param_local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "param_full_numel": sum(p.numel() for p in params),
        "ema_dtypes": sorted({str(t.dtype) for t in ema.shards.tensors()[: len(params)]}),
    }


def resume(name: str, ckpt: Path, out: Path, tag: str, steps: int = 8) -> dict:
    L.seed_everything(0, verbose=False)
    model, plain, snap = Classifier("encoder"), PlainEMA(), Snapshots()
    trainer = make_trainer(name, steps, [new_ema(), plain, snap])
    trainer.fit(model, loader(n=128), loader(n=16, seed=1), ckpt_path=str(ckpt))
    torch.save(snap.restored, out / f"{tag}-restored-rank{RANK}.pt")
    torch.save(ema_full(trainer), out / f"{tag}-ema-final-rank{RANK}.pt")
    torch.save(plain.ema, out / f"{tag}-plain-final-rank{RANK}.pt")
    return {
        "oracle_diff": max_diff(ema_full(trainer), plain.ema),
        "updates": ema_of(trainer).updates,
        "global_step": trainer.global_step,
        "losses": model.losses,
    }


def bf16_true() -> dict:
    """bf16 master weights: the EMA stays fp32 and follows the fp32 formula on the upcast weights."""
    L.seed_everything(0, verbose=False)
    model, plain = Classifier("encoder"), PlainEMA()
    trainer = make_trainer("vitscale", 3, [new_ema(), plain], precision="bf16-true", limit_val_batches=0)
    trainer.fit(model, loader(n=64))
    return {
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "ema_dtypes": sorted({str(t.dtype) for t in ema_of(trainer).shards.tensors()}),
        "oracle_diff": max_diff(ema_full(trainer), plain.ema),
    }


def timed(fn, *args) -> dict:
    start = time.monotonic()
    facts = fn(*args)
    return {**facts, "seconds": time.monotonic() - start}


def two_ranks(out: Path) -> dict:
    results = {f"save_{name}": timed(train_and_save, name, out) for name in ("ddp", "vitscale")}
    for name in ("ddp", "vitscale"):
        results[f"resume_{name}"] = timed(resume, name, out / f"{name}-step4.ckpt", out, f"resume_{name}")
    # a DDP .ckpt (whole tensors) into VitScaleStrategy: each rank keeps its slice of the EMA
    results["ddp_to_vitscale"] = timed(resume, "vitscale", out / "ddp-step4.ckpt", out, "ddp_to_vitscale", 5)
    results["bf16_true"] = timed(bf16_true)
    for name in ("vitscale", "ddp"):  # the one-file checkpoint resumed under both strategies
        results[f"full_{name}"] = timed(resume, name, out / "vitscale-full-step4.ckpt", out, f"full_{name}", 5)
    return results


def one_rank(out: Path) -> dict:
    results = {"resume_2_to_1": timed(resume, "vitscale", out / "vitscale-step4.ckpt", out, "resume_2_to_1")}
    results["full_1"] = timed(resume, "vitscale", out / "vitscale-full-step4.ckpt", out, "full_1", 5)
    trainer = make_trainer("vitscale", 1, [], limit_val_batches=0)  # a checkpoint saved without ShardedEMA
    trainer.fit(Classifier("encoder"), loader(n=8))
    trainer.save_checkpoint(out / "plain-step4.ckpt")
    return results


def four_ranks(out: Path) -> dict:
    return {"full_4": timed(resume, "vitscale", out / "vitscale-full-step4.ckpt", out, "full_4", 5)}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    results = {"two": two_ranks, "one": one_rank, "four": four_ranks}[mode](out)
    (out / f"{mode}-rank{RANK}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
