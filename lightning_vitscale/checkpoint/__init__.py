"""Checkpoints: the sharded folder and DDP's single-file formats, the one safe reader every load goes through, the
strategy's save/load/remove (``strategy_side.py``), the atomic commit of a save, resuming from the newest complete
checkpoint, consolidation into one file, and ``model.state_dict()`` as DDP's full tensors.

This face is the core's. Sub-rooms with their own faces: ``export/``, ``lightning/`` and ``fsdp1/``; the core, this
``__init__`` included, imports none of them, and loading never imports saving (import-linter). May import
``row_layout``, ``distributed`` (the side-group handshake before a gather), ``precision`` (an optimizer's state made
on local tensors), ``_utils`` and ``_compat``.
"""

from lightning_vitscale.checkpoint.consolidate import consolidate_checkpoint, consolidated, load_consolidated
from lightning_vitscale.checkpoint.errors import AsyncSaveError, CheckpointError, StateDictGatherError
from lightning_vitscale.checkpoint.exception_save import unless_alone_in_exception
from lightning_vitscale.checkpoint.manifest import verify
from lightning_vitscale.checkpoint.settings import CheckpointSettings, StateDictType
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.checkpoint.strategy_side import OnCheckpointSide, StrategyCheckpoints, model_state_after_hook

__all__ = [
    "AsyncSaveError",
    "CheckpointError",
    "CheckpointSettings",
    "Location",
    "OnCheckpointSide",
    "StateDictGatherError",
    "StateDictType",
    "StrategyCheckpoints",
    "model_state_after_hook",
    "consolidate_checkpoint",
    "consolidated",
    "load_consolidated",
    "unless_alone_in_exception",
    "verify",
]
