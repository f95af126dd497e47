"""Checkpoints: the sharded folder and DDP's single-file formats, the one safe reader every load goes through,
the strategy's save/load/remove, consolidation into one file, Lightning's own loaders reading sharded folders, and
``model.state_dict()`` as DDP's full tensors.

May import ``distributed`` (the side-group handshake before a gather), ``_utils`` and ``_compat``.
"""

from lightning_vitscale.checkpoint.async_save import AsyncSaveError, AsyncSaves
from lightning_vitscale.checkpoint.consolidate import consolidate_checkpoint, consolidate_command, load_consolidated
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.full_state_dict import StateDictGatherError
from lightning_vitscale.checkpoint.lightning_loaders import install_checkpoint_loader
from lightning_vitscale.checkpoint.load import load_checkpoint
from lightning_vitscale.checkpoint.save import (
    model_state_dict,
    optimizer_state_dict,
    remove_checkpoint,
    save_checkpoint,
    sharded_save_hint,
)
from lightning_vitscale.checkpoint.settings import CheckpointSettings, StateDictType
from lightning_vitscale.checkpoint.storage import Location

__all__ = [
    "AsyncSaveError",
    "AsyncSaves",
    "CheckpointError",
    "CheckpointSettings",
    "Location",
    "StateDictGatherError",
    "StateDictType",
    "consolidate_checkpoint",
    "consolidate_command",
    "install_checkpoint_loader",
    "load_checkpoint",
    "load_consolidated",
    "model_state_dict",
    "optimizer_state_dict",
    "remove_checkpoint",
    "save_checkpoint",
    "sharded_save_hint",
]
