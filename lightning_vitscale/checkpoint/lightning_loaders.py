"""Lightning's own loaders read this package's sharded checkpoint folders, as they read DDP's single files.

``MyModule.load_from_checkpoint(path)`` and a resume under ``strategy="ddp"`` or a single device
(``trainer.fit(model, ckpt_path=path)``, via ``TorchCheckpointIO``) both open ``path`` with Lightning's
``pl_load`` before any strategy code runs, so a folder fails with ``IsADirectoryError`` and Lightning offers no
public hook there (a custom ``CheckpointIO`` would serve the Trainer only, and only if the user passed it). So
importing ``lightning_vitscale`` wraps the ``pl_load`` name in the two Lightning modules that call it. The wrapper
is inert for every other path: it handles only a folder holding this package's marker file
(``checkpoint.storage.SHARDED_MARKER``, written last by every sharded save) and calls Lightning's original for
anything else (files, buffers, ``http`` URLs, other folders), which therefore fails or loads exactly as before.

A marked folder is read in one process with no process group (each DDP rank reads it all, as it reads DDP's
file) into the dict ``torch.load`` returns for the consolidated file: the same weights, hyper-parameters,
torch-native optimizer states and loop state, under the same ``weights_only`` rule (torch's safe default, so a
crafted pickle never runs).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from lightning_vitscale._compat import PL_LOAD_MODULES, restore_location, tree_map
from lightning_vitscale.checkpoint.consolidate import load_consolidated
from lightning_vitscale.checkpoint.storage import Location, has_sharded_marker

_ORIGINAL = "vitscale_original"
_NAME = "pl_load"  # Lightning's name for cloud_io._load in the modules of PL_LOAD_MODULES


def is_sharded_checkpoint(path: Any) -> bool:
    """A local path or fsspec URL naming a folder this package saved (never raises: anything else is not ours)."""
    if not isinstance(path, (str, os.PathLike)) or str(path).startswith("http"):
        return False  # buffers and http URLs: Lightning's own branches
    try:
        return has_sharded_marker(Location.of(path))
    except Exception:  # noqa: BLE001 - an unknown protocol, a missing fsspec backend: Lightning reports it as before
        return False


def load_sharded_as_full(path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
    """What ``torch.load(path, map_location, weights_only)`` returns for the consolidated file of ``path``.

    ``map_location`` follows ``torch.load``'s rule, with every tensor's saved location being ``"cpu"`` (the shards
    are read to CPU; DDP's file records the device each tensor was saved from instead)."""
    checkpoint = load_consolidated(path, dtype=None, weights_only=weights_only)
    return map_tensors(checkpoint, map_location)


def map_tensors(checkpoint: dict[str, Any], map_location: Any) -> dict[str, Any]:
    if map_location is None:
        return checkpoint
    restore = restore_location(map_location)
    return tree_map(lambda value: _restored(value, restore) if torch.is_tensor(value) else value, checkpoint)


def _restored(tensor: torch.Tensor, restore: Callable[[Any, str], Any]) -> torch.Tensor:
    storage = restore(tensor.untyped_storage(), "cpu")
    if storage.device == tensor.device:
        return tensor
    moved = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    return moved.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
        if is_sharded_checkpoint(path_or_url):
            return load_sharded_as_full(path_or_url, map_location=map_location, weights_only=weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only, **kwargs)

    setattr(pl_load, _ORIGINAL, original)
    return pl_load


def install_checkpoint_loader() -> None:
    """Wrap Lightning's ``pl_load`` names once (idempotent; importing ``lightning_vitscale`` calls it)."""
    for module in PL_LOAD_MODULES:
        current = getattr(module, _NAME)
        if not hasattr(current, _ORIGINAL):
            setattr(module, _NAME, _wrap(current))
