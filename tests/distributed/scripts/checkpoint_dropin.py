"""Rank script for checkpoint habits from DDP: lr_find's save/restore, full single files, fsspec URLs, crafted
pickles. Every scenario runs under DDP too, as the oracle."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from unittest import mock

import lightning as L
import torch
from lightning.pytorch.tuner import Tuner

import lightning_vitscale.checkpoint.load as checkpoint_load
import lightning_vitscale.checkpoint.strategy_side as strategy_side
from lightning_vitscale import VitScaleCheckpointIO, VitScaleStrategy
from lightning_vitscale.checkpoint import Location
from lightning_vitscale.checkpoint.manifest import file_sum
from lightning_vitscale.checkpoint.save import remove_checkpoint
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER
from lightning_vitscale.distributed.ranks import RankContext
from tests.distributed.scripts.checkpoints import RANK, WORLD, equal, make_trainer, snapshot
from tests.helpers.exploit import Payload
from tests.helpers.models import Classifier, loader
from tests.helpers.scenarios import run_scenarios

OUT = Path(sys.argv[1])


class WithoutScheduler(Classifier):
    """No LR scheduler of its own: lr_find's scheduler then adds ``initial_lr`` after the temporary save."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)


def strategy_for(name: str, state_dict_type: str = "sharded"):
    return VitScaleStrategy(state_dict_type=state_dict_type) if name == "vitscale" else "ddp"


def lr_find() -> dict:
    """Tuner.lr_find saves, runs its LR sweep, restores: same sweep and suggestion as DDP, no folder left."""
    results = {}
    for name in ("ddp", "vitscale"):
        L.seed_everything(0, verbose=False)
        model = WithoutScheduler("encoder")
        before = {f"w.{n}": p.detach().clone() for n, p in model.named_parameters()}  # before any sharding
        root = OUT / f"lr-{name}"
        trainer = make_trainer(strategy_for(name), 4, default_root_dir=str(root))
        finder = Tuner(trainer).lr_find(model, train_dataloaders=loader(n=128), num_training=14,
                                        early_stop_threshold=None)
        restored = equal(before, {k: v for k, v in snapshot(model, trainer).items() if k.startswith("w.")})
        model.losses.clear()
        trainer.fit(model, loader(n=128))  # the real run, with the suggested LR
        results[name] = {
            "lrs": finder.results["lr"], "sweep_losses": finder.results["loss"], "suggestion": finder.suggestion(),
            "lr_used": model.hparams.lr, "restored": restored, "losses": model.losses,
            "left": sorted(p.name for p in root.glob(".lr_find*")),
        }
    return results


def _slowed(rank: int, seconds: float, function, only_for: Path | None = None):
    """``function``, made ``seconds`` slower on ``rank`` only (one rank lags as a loaded node would); with
    ``only_for``, only for a call on that path (removing a checkpoint also removes its ``.partial``
    sibling and its marker file: slowing each made this scenario ~25 s instead of ~7)."""

    def slowed(*args, **kwargs):
        if RANK == rank and (only_for is None or Path(args[0].path) == only_for):
            time.sleep(seconds)
        return function(*args, **kwargs)

    return slowed


def _load_then_remove(trainer: L.Trainer, path: Path, remove) -> dict:
    """Load ``path`` then ``remove`` it, as lr_find does, with rank 1 still reading the folder's ``meta.pt``
    (slowed by 0.8 s) when rank 0 is done, and rank 0's delete of the folder slowed by 0.5 s (1.5 s and 1 s
    before: ~5 s of this launch's sleeping; each barrier's removal still fails the test)."""
    trainer.save_checkpoint(path)
    error = None
    with mock.patch.object(checkpoint_load, "load_member", _slowed(1, 0.8, checkpoint_load.load_member)), \
            mock.patch.object(Location, "remove", _slowed(0, 0.5, Location.remove, only_for=path)):
        try:
            trainer.strategy.load_checkpoint(path)
        except Exception as caught:  # noqa: BLE001
            error = f"{type(caught).__name__}: {caught}"
        remove(path)
        return {"load_error": error, "exists_on_return": path.exists()}


def remove_while_reading() -> dict:
    """A sharded folder goes only once every rank is done with it, and is gone on every rank once removal
    returns: through ``strategy.remove_checkpoint``, and through ``checkpoint.remove_checkpoint`` alone. On gloo the
    strategy's broadcast of the path already waits for every rank (a gloo broadcast returns on the root only
    once all ranks joined it), so only the second case observes ``remove``'s first barrier (NCCL's broadcast
    does not wait on the host)."""
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    trainer = make_trainer(VitScaleStrategy(), 2, default_root_dir=str(OUT / "remove"))
    trainer.fit(model, loader(n=64))
    strategy = trainer.strategy
    folder = OUT / "remove"
    ranks = RankContext(rank=RANK, barrier=strategy.barrier)
    return {
        "strategy": _load_then_remove(trainer, folder / "a.ckpt", strategy.remove_checkpoint),
        "function": _load_then_remove(trainer, folder / "b.ckpt", lambda p: remove_checkpoint(Location.of(p), ranks)),
    }


def save_formats() -> dict:
    """DDP writes ddp.ckpt; VitScaleStrategy writes the same run as one full file and as a sharded file:// URL."""
    told: list[str] = []

    def record(message, *args, **kwargs):
        told.append(str(message))

    with mock.patch.object(strategy_side, "rank_zero_info", record):  # the hint, from this scenario's saves only
        for name in ("ddp", "vitscale"):
            L.seed_everything(0, verbose=False)
            model = Classifier("encoder")
            trainer = make_trainer(strategy_for(name, "full"), 8)
            trainer.fit(model, loader(n=128))
            if name == "ddp":
                trainer.save_checkpoint(OUT / "ddp.ckpt")
                trainer.save_checkpoint(OUT / "ddp-weights-only.ckpt", weights_only=True)
                continue
            trainer.save_checkpoint(OUT / "full.ckpt")
            trainer.strategy.state_dict_type = "sharded"
            trainer.save_checkpoint(f"file://{OUT}/sharded.ckpt")
            trainer.save_checkpoint(f"file://{OUT}/sharded.ckpt")  # again: the atomic swap on fsspec
            trainer.save_checkpoint(OUT / "weights-only.ckpt", weights_only=True)
    return {"told": told, "full_is_file": (OUT / "full.ckpt").is_file(), "sharded": sorted(
        p.name for p in (OUT / "sharded.ckpt").iterdir()), "stray": sorted(p.name for p in OUT.glob("sharded.ckpt.*"))}


def resume(name: str, path: str) -> list[float]:
    """Under DDP, a sharded folder through the IO plugin users pass for it (files through Lightning's own IO)."""
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    plugins = [VitScaleCheckpointIO()] if name == "ddp" and Location.of(path).is_dir() else None
    make_trainer(strategy_for(name), 12, plugins=plugins).fit(model, loader(n=128), ckpt_path=path)
    return model.losses


def resumes() -> dict:
    return {
        "ddp_from_ddp": resume("ddp", str(OUT / "ddp.ckpt")),
        "ddp_from_full": resume("ddp", str(OUT / "full.ckpt")),
        "vitscale_from_full": resume("vitscale", str(OUT / "full.ckpt")),
        "vitscale_from_url": resume("vitscale", f"file://{OUT}/sharded.ckpt"),
        "ddp_from_sharded": resume("ddp", str(OUT / "sharded.ckpt")),  # through VitScaleCheckpointIO
    }


def checkpoint_hooks() -> dict:
    """Save after 2 steps, resume to 4 with ``on_load_checkpoint`` editing ``checkpoint["state_dict"]``
    (``tests/helpers/checkpoint_hooks.py``): under DDP, a sharded folder and a full file."""
    from torch.distributed.tensor import DTensor

    from tests.helpers.checkpoint_hooks import CheckpointHooks

    found: dict = {}
    for name, kind in (("ddp", "sharded"), ("vitscale", "sharded"), ("vitscale", "full")):
        trainer = make_trainer(strategy_for(name, kind), 2)
        trainer.fit(CheckpointHooks("none"))
        path = OUT / f"hooks-{name}-{kind}.ckpt"
        trainer.save_checkpoint(path)
        for edit in ("edit", "remove"):
            model = CheckpointHooks(edit)
            try:
                make_trainer(strategy_for(name, kind), 4).fit(model, ckpt_path=path)
            except Exception as error:  # noqa: BLE001 - the message is the result
                found[f"{edit}/{name}-{kind}"] = {"error": f"{type(error).__name__}: {error}"}
                continue
            head = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.net.head.state_dict(
                keep_vars=True).items()}
            found[f"{edit}/{name}-{kind}"] = {
                "losses": model.losses, "counter": model.counter, "queue": model.queue.tolist(),
                "keys": model.state_dict_keys, "head": {k: v.detach().flatten().tolist() for k, v in head.items()}}
    return found


def reseal(folder: Path, name: str) -> None:
    """Record a crafted file's size and CRC-32 in the folder's manifest, as whoever crafts it can: the checksums
    catch damaged storage, not tampering, so the pickle must reach the safe reader and be refused there."""
    marker = folder / SHARDED_MARKER
    manifest = json.loads(marker.read_text())
    written = file_sum(Location.of(str(folder / name)))
    manifest["files"][name] = {"size": written.size, "crc32": f"{written.crc32:08x}"}
    marker.write_text(json.dumps(manifest, indent=1))


def crafted() -> dict:
    """A payload in a full file, in a sharded folder's meta.pt (resumed under our strategy and under DDP) and in its
    DCP .metadata: none may run. And a fit resumed from a weights-only checkpoint fails as under DDP."""
    import pickle
    import shutil

    marker = OUT / "pwned"
    if RANK == 0:
        checkpoint = torch.load(OUT / "ddp.ckpt", weights_only=True)
        checkpoint["hyper_parameters"]["backbone"] = Payload(marker)
        torch.save(checkpoint, OUT / "crafted.ckpt")
        for folder in ("crafted-meta.ckpt", "crafted-dcp.ckpt"):
            shutil.copytree(OUT / "sharded.ckpt", OUT / folder)
        meta = torch.load(OUT / "crafted-meta.ckpt" / "meta.pt", weights_only=True)
        meta["hyper_parameters"]["backbone"] = Payload(marker)
        torch.save(meta, OUT / "crafted-meta.ckpt" / "meta.pt")
        dcp_meta = pickle.loads((OUT / "crafted-dcp.ckpt" / ".metadata").read_bytes())
        dcp_meta.planner_data["x"] = Payload(marker)
        (OUT / "crafted-dcp.ckpt" / ".metadata").write_bytes(pickle.dumps(dcp_meta))
        for folder, name in (("crafted-meta.ckpt", "meta.pt"), ("crafted-dcp.ckpt", ".metadata")):
            reseal(OUT / folder, name)
    torch.distributed.barrier()
    errors = {}
    for label, name, path in [("ddp_full", "ddp", "crafted.ckpt"), ("vitscale_full", "vitscale", "crafted.ckpt"),
                              ("vitscale_meta", "vitscale", "crafted-meta.ckpt"),
                              ("vitscale_dcp", "vitscale", "crafted-dcp.ckpt"),
                              ("ddp_weights_only", "ddp", "ddp-weights-only.ckpt"),
                              ("vitscale_weights_only_full", "vitscale", "ddp-weights-only.ckpt"),
                              ("vitscale_weights_only_sharded", "vitscale", "weights-only.ckpt"),
                              ("ddp_meta", "ddp", "crafted-meta.ckpt"),
                              ("ddp_weights_only_sharded", "ddp", "weights-only.ckpt")]:
        try:
            resume(name, str(OUT / path))
            errors[label] = "no error"
        except Exception as error:  # noqa: BLE001
            errors[label] = f"{type(error).__name__}: {error}"
    return {"errors": errors, "ran": marker.exists()}


def scale_batch_size() -> dict:
    """Lightning refuses the batch-size tuner for every distributed strategy: the same refusal as DDP."""
    messages = {}
    for name in ("ddp", "vitscale"):
        try:
            Tuner(make_trainer(strategy_for(name), 2)).scale_batch_size(Classifier("encoder"))
            messages[name] = "no error"
        except Exception as error:  # noqa: BLE001
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


if __name__ == "__main__":
    assert WORLD == 2
    run_scenarios({"lr_find": lr_find, "save_formats": save_formats, "resumes": resumes, "crafted": crafted,
                   "scale_batch_size": scale_batch_size, "remove_while_reading": remove_while_reading,
                   "checkpoint_hooks": checkpoint_hooks})
