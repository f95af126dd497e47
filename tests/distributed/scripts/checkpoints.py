"""Rank script for sharded checkpoints: exact resume vs DDP, world-size changes, export, bad input, crashes."""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.checkpoint import consolidate_checkpoint
from tests.helpers.models import Classifier, loader
from tests.helpers.recording import count_collectives
from tests.helpers.state import snapshot

warnings.filterwarnings("ignore")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
FIXED = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(7))



def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Resumable(Classifier):
    def on_train_start(self) -> None:
        self.restored = snapshot(self, self.trainer)


def make_trainer(strategy, steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False, **kwargs,
    )


def strategy_for(name: str):
    return VitScaleStrategy() if name == "vitscale" else "ddp"


class Exported(Resumable):
    def predict_step(self, batch, batch_idx):
        return self(batch[0])


def logits(trainer: L.Trainer, model: L.LightningModule) -> list:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(FIXED), batch_size=2)
    return trainer.predict(model, data, return_predictions=True)


def train_and_save(name: str, out: Path) -> dict:
    L.seed_everything(0, verbose=False)
    model = Exported("encoder")
    trainer = make_trainer(strategy_for(name), 8)
    trainer.fit(model, loader(n=128))
    path = out / f"{name}-step8.ckpt"
    if name == "vitscale":
        with count_collectives() as counts:
            trainer.save_checkpoint(path)
        save_counts = dict(counts)
    else:
        trainer.save_checkpoint(path)
        save_counts = {}
    saved = snapshot(model, trainer)
    torch.save(saved, out / f"{name}-saved-rank{RANK}.pt")
    facts = {"path": str(path), "save_collectives": save_counts}
    if name == "vitscale":  # the export test's model: predict, then save (a separate identical fit before)
        facts["sharded_logits"] = torch.cat(logits(trainer, model)).tolist()  # this rank's half of FIXED
        trainer.save_checkpoint(out / "for-export.ckpt")
    return facts


def resume(name: str, ckpt: Path, out: Path, tag: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = Resumable("encoder")
    trainer = make_trainer(strategy_for(name), 16)
    trainer.fit(model, loader(n=128), ckpt_path=str(ckpt))
    torch.save(model.restored, out / f"{tag}-restored-rank{RANK}.pt")
    return {"losses": model.losses, "global_step": trainer.global_step}


def save_memory(out: Path) -> dict:
    """Bytes each rank wrote vs what it holds locally: no rank writes (or gathers) the whole model."""
    ckpt = out / "vitscale-step8.ckpt"
    files = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    return {"files": files}


def bad_inputs(out: Path) -> dict:
    (out / "garbage.ckpt").write_bytes(os.urandom(1000))
    (out / "foreign-dir").mkdir(exist_ok=True)
    (out / "foreign-dir" / "notes.txt").write_text("not a checkpoint")
    errors = {}
    for label, path, backbone in [
        ("missing", out / "nope.ckpt", "encoder"),
        ("garbage", out / "garbage.ckpt", "encoder"),
        ("foreign_dir", out / "foreign-dir", "encoder"),
        ("mismatch_sharded", out / "vitscale-step8.ckpt", "resnet"),
        ("mismatch_full", out / "ddp-step8.ckpt", "resnet"),
        ("shapes", out / "vitscale-step8.ckpt", "encoder_wide"),
    ]:
        try:
            make_trainer(VitScaleStrategy(), 9).fit(Classifier(backbone), loader(n=64), ckpt_path=str(path))
            errors[label] = "no error"
        except Exception as error:  # noqa: BLE001
            errors[label] = f"{type(error).__name__}: {error}"
    return errors


def kill_during_save(out: Path) -> None:
    """Save A completely, then rank 1 dies while writing B: the job ends, A must stay loadable."""
    from torch.distributed.checkpoint import FileSystemWriter

    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    trainer = make_trainer(VitScaleStrategy(), 2)
    trainer.fit(model, loader(n=64))
    trainer.save_checkpoint(out / "A.ckpt")
    trainer.save_checkpoint(out / "B.ckpt")  # a complete B first, so an interrupted save must not destroy it
    original = FileSystemWriter.write_data

    def dying_write(self, plan, planner):
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    FileSystemWriter.write_data = dying_write
    (out / "kill_started").write_text("1")
    trainer.save_checkpoint(out / "B.ckpt")


def after_kill(out: Path) -> dict:
    facts = {}
    for label in ("A", "B"):
        try:
            model = Classifier("encoder")
            make_trainer(VitScaleStrategy(), 3).fit(model, loader(n=64), ckpt_path=str(out / f"{label}.ckpt"))
            facts[label] = "loaded"
        except Exception as error:  # noqa: BLE001
            facts[label] = f"{type(error).__name__}: {error}"
    try:
        partial = str(out / "B.ckpt.partial")
        make_trainer(VitScaleStrategy(), 3).fit(Classifier("encoder"), loader(n=64), ckpt_path=partial)
        facts["partial"] = "loaded"
    except Exception as error:  # noqa: BLE001
        facts["partial"] = f"{type(error).__name__}: {error}"
    return facts


def two_ranks(out: Path) -> dict:
    results = {}
    for name in ("ddp", "vitscale"):
        results[f"save_{name}"] = train_and_save(name, out)
    for name in ("ddp", "vitscale"):
        results[f"resume_{name}"] = resume(name, out / f"{name}-step8.ckpt", out, f"resume_{name}")
    results["ddp_to_vitscale"] = resume("vitscale", out / "ddp-step8.ckpt", out, "ddp_to_vitscale")
    if RANK == 0:
        consolidate_checkpoint(out / "vitscale-step8.ckpt", out / "consolidated.ckpt")
    dist.barrier()
    results["consolidated_to_ddp"] = resume("ddp", out / "consolidated.ckpt", out, "consolidated_to_ddp")
    results["sharded_logits"] = results["save_vitscale"]["sharded_logits"]
    results["save_memory"] = save_memory(out)
    results["bad_inputs"] = bad_inputs(out)
    return results


def one_rank(out: Path) -> dict:
    """2 -> 1: load the 2-rank checkpoint on one rank, then 1 -> 2: save here for the next 2-rank job."""
    results = {"resume_2_to_1": resume("vitscale", out / "vitscale-step8.ckpt", out, "resume_2_to_1")}
    L.seed_everything(0, verbose=False)
    model = Resumable("encoder")
    trainer = make_trainer(VitScaleStrategy(), 4)
    trainer.fit(model, loader(n=64))
    trainer.save_checkpoint(out / "one-rank.ckpt")
    torch.save(snapshot(model, trainer), out / "one-rank-saved.pt")
    return results


class StartStep(Classifier):
    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step


def fit_with_checkpoints(folder: Path, steps: int, ckpt_path: str | None = None, **strategy) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=VitScaleStrategy(**strategy), max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[checkpoints],
    )
    model = StartStep("encoder")
    trainer.fit(model, loader(n=64), ckpt_path=ckpt_path)
    return trainer


def flip_a_byte(folder: Path) -> None:
    shard = next(p for p in sorted(folder.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))


def resume_newest_complete(out: Path) -> dict:
    """Through Trainer.fit: ckpt_path="last" after a crash inside the publish of last.ckpt (the old folder
    retired, the committed new one still .partial), then auto_resume past the corrupt newest checkpoints."""
    folder, facts = out / "auto", {}
    fit_with_checkpoints(folder, 4)
    if RANK == 0:
        (folder / "last.ckpt").rename(folder / "last.ckpt.partial")
    dist.barrier()
    trainer = fit_with_checkpoints(folder, 6, ckpt_path="last")
    facts["last"] = {"start": trainer.lightning_module.start_step, "path": str(trainer.ckpt_path)}
    if RANK == 0:
        for newest in [p for p in folder.iterdir() if "step=6" in p.name or p.name == "last.ckpt"]:
            flip_a_byte(newest)
    dist.barrier()
    trainer = fit_with_checkpoints(folder, 8, auto_resume=True)
    facts["auto"] = {"start": trainer.lightning_module.start_step, "path": str(trainer.ckpt_path)}
    try:
        L.Trainer(accelerator="cpu", devices=WORLD, strategy=VitScaleStrategy(auto_resume=True), max_steps=1,
                  logger=False, enable_checkpointing=False).fit(Classifier("encoder"), loader(n=64))
        facts["no_folder"] = "no error"
    except ValueError as error:
        facts["no_folder"] = str(error)
    return facts


def two_ranks_again(out: Path) -> dict:
    results = {"resume_1_to_2": resume("vitscale", out / "one-rank.ckpt", out, "resume_1_to_2")}
    results["after_kill"] = after_kill(out)
    results["newest_complete"] = resume_newest_complete(out)
    return results


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode == "kill":
        kill_during_save(out)
        return
    results = {"two": two_ranks, "one": one_rank, "again": two_ranks_again}[mode](out)
    (out / f"{mode}-rank{RANK}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
