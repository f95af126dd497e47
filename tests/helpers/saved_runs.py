"""Sharded checkpoints of real example modules written by the package's own save path (one process, no Trainer):
what a VitScaleStrategy run leaves in its checkpoint folder, in milliseconds."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from lightning_vitscale.checkpoint.manifest import file_sums, read_manifest, write_manifest
from lightning_vitscale.checkpoint.save import save_sharded
from lightning_vitscale.checkpoint.storage import Location


def save_run(path: Path, module: nn.Module, ema_scale: float | None = None, **meta) -> Path:
    """``module``'s state as a sharded folder at global step 7, with an EMA entry (weights * ``ema_scale``)."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    checkpoint = {"state_dict": state, "global_step": 7, "epoch": 1, **meta}
    if ema_scale is not None:
        checkpoint["ema_state_dict"] = {k: v * ema_scale for k, v in state.items() if v.is_floating_point()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        save_sharded(checkpoint, Location.of(path))
    return path


def save_dino_run(path: Path) -> Path:
    """The DINO example's module (tiny, digits) with a teacher unlike its student, and an EMA = weights / 2."""
    from examples.pretraining import DINOPretraining

    torch.manual_seed(0)
    module = DINOPretraining()
    module.configure_model()
    assert module.teacher is not None
    with torch.no_grad():
        for p in module.teacher.parameters():
            p.add_(torch.randn_like(p))
    return save_run(path, module, ema_scale=0.5, hyper_parameters=dict(module.hparams))


def restamp(folder: Path) -> None:
    """The folder's manifest rewritten with the sizes and CRC-32s its files have now: what whoever crafts a file
    does too (the CRC-32s catch damage, not edits), so the safe reader's own refusals are what a test meets."""
    location = Location.of(folder)
    listed = read_manifest(location)
    assert listed is not None
    write_manifest(location, file_sums(location, list(listed["files"])), {"global_step": listed.get("global_step")})
