"""Checkpoints: the sharded folder and DDP's single-file formats, the one safe reader every load goes through,
the strategy's save/load/remove, the atomic commit of a save, resuming from the newest complete checkpoint
(``ckpt_path="last"``, ``auto_resume``), consolidation into one file, export of a submodule's weights to published
formats (``export/``), Lightning's own loaders reading sharded
folders, and ``model.state_dict()`` as DDP's full tensors.

Four rooms: the core (save, commit, manifest, storage; verified load, load, formats; the safe reader and its
confinement; ``strategy_side.py``, what the strategy's hooks call), ``export/`` (a checkpoint's weights in
published formats), ``lightning/`` (Lightning's loaders and every patch of Lightning, ``lightning/patches.py``)
and ``fsdp1/`` (importing FSDP1 / FairScale-era checkpoints). The core imports no sub-room, and loading never
imports saving (import-linter contracts in pyproject.toml). Every error class is in ``errors.py``.

May import ``distributed`` (the side-group handshake before a gather), ``_utils`` and ``_compat``.
"""

import dataclasses
import warnings
from typing import Any

from lightning_vitscale.checkpoint.async_save import AsyncSaves
from lightning_vitscale.checkpoint.commit import commit, newest_complete
from lightning_vitscale.checkpoint.consolidate import consolidate_checkpoint, consolidate_command, load_consolidated
from lightning_vitscale.checkpoint.errors import AsyncSaveError, CheckpointError, StateDictGatherError
from lightning_vitscale.checkpoint.lightning.patches import install_import_patches, install_strategy_patches
from lightning_vitscale.checkpoint.load import load_checkpoint
from lightning_vitscale.checkpoint.manifest import verify
from lightning_vitscale.checkpoint.save import (
    model_state_dict,
    optimizer_state_dict,
    remove_checkpoint,
    save_checkpoint,
)
from lightning_vitscale.checkpoint.settings import CheckpointSettings, StateDictType
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.checkpoint.strategy_side import OnCheckpointSide, StrategyCheckpoints, sharded_save_hint
from lightning_vitscale.checkpoint.verified import verified_checkpoint
from lightning_vitscale.distributed.ranks import RankContext


def install_checkpoint_loader() -> None:
    """Deprecated alias: importing ``lightning_vitscale`` installs what is needed (``lightning/patches.py``)."""
    warnings.warn(
        "install_checkpoint_loader() is deprecated: `import lightning_vitscale` installs the pl_load wrappers"
        " (lightning_vitscale/checkpoint/lightning/patches.py).",
        DeprecationWarning,
        stacklevel=2,
    )
    install_import_patches()


def install_resume_hooks() -> None:
    """Deprecated alias: the import and ``VitScaleStrategy()`` install them (``lightning/patches.py``)."""
    warnings.warn(
        "install_resume_hooks() is deprecated: `import lightning_vitscale` wraps `ckpt_path=\"last\"` and creating"
        " a VitScaleStrategy wraps auto_resume's ckpt_path (lightning_vitscale/checkpoint/lightning/patches.py).",
        DeprecationWarning,
        stacklevel=2,
    )
    install_import_patches()
    install_strategy_patches()


def HashGroup(rank: int = 0, world_size: int = 1, gather: Any = None) -> RankContext:  # noqa: N802 - the old class
    """Deprecated: checkpoints take the one rank context, :class:`lightning_vitscale.distributed.RankContext`."""
    warnings.warn(
        "lightning_vitscale.checkpoint.HashGroup is deprecated; pass a lightning_vitscale.distributed.RankContext"
        " (rank=, world_size=, all_gather_objects=) instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    context = RankContext(rank=rank, world_size=world_size)
    return context if gather is None else dataclasses.replace(context, all_gather_objects=gather)


__all__ = [
    "AsyncSaveError",
    "AsyncSaves",
    "CheckpointError",
    "CheckpointSettings",
    "HashGroup",
    "Location",
    "OnCheckpointSide",
    "StateDictGatherError",
    "StateDictType",
    "StrategyCheckpoints",
    "commit",
    "consolidate_checkpoint",
    "consolidate_command",
    "install_checkpoint_loader",
    "install_import_patches",
    "install_resume_hooks",
    "install_strategy_patches",
    "load_checkpoint",
    "load_consolidated",
    "model_state_dict",
    "newest_complete",
    "optimizer_state_dict",
    "remove_checkpoint",
    "save_checkpoint",
    "sharded_save_hint",
    "verified_checkpoint",
    "verify",
]
