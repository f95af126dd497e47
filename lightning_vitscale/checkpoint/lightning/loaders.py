"""A sharded folder where Lightning reads DDP's file: :class:`VitScaleCheckpointIO` reads a folder with this
package's marker in one process, as ``torch.load`` of its consolidated file; anything else is Lightning's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_vitscale._compat import restore_location, tree_map
from lightning_vitscale.checkpoint.consolidate import load_consolidated
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER, Location


class VitScaleCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` that also reads ``VitScaleStrategy``'s sharded folders: a DDP or
    single-device run resumes from one with weights, optimizer and loop state.

    Example::

        trainer = Trainer(strategy="ddp", plugins=[VitScaleCheckpointIO()])
        trainer.fit(model, ckpt_path="checkpoints/last.ckpt")  # a folder VitScaleStrategy saved
    """

    @override
    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """A folder: what ``torch.load(path, map_location, weights_only)`` returns for its consolidated file, every
        tensor's saved location being ``"cpu"`` (DDP's file records the device it was saved from instead)."""
        if not is_sharded_checkpoint(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        checkpoint = load_consolidated(path, dtype=None, weights_only=weights_only)
        if map_location is None:
            return checkpoint
        restore = restore_location(map_location)
        return tree_map(lambda value: _restored(value, restore) if torch.is_tensor(value) else value, checkpoint)


def is_sharded_checkpoint(path: Any) -> bool:
    """A local path or fsspec URL naming a folder this package saved (never raises: anything else is not ours)."""
    if not isinstance(path, (str, os.PathLike)) or str(path).startswith("http"):
        return False  # buffers and http URLs: Lightning's own branches
    try:
        folder = Location.of(path)
        return folder.is_dir() and folder.child(SHARDED_MARKER).is_file()
    except Exception:  # noqa: BLE001 - an unknown protocol, a missing fsspec backend: Lightning reports it as before
        return False


def _restored(tensor: torch.Tensor, restore: Callable[[Any, str], Any]) -> torch.Tensor:
    storage = restore(tensor.untyped_storage(), "cpu")
    if storage.device == tensor.device:
        return tensor
    moved = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    return moved.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
