"""What a checkpoint holds: a sharded folder (DCP shards, Lightning's metadata, extra sharded entries such as the
EMA) or one ``torch.save`` file; its shapes read and checked against the model before any collective."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import METADATA_FILENAME, tree_leaves
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.manifest import why_incomplete
from lightning_vitscale.checkpoint.safe_reading import load_into, load_pickle, read_metadata
from lightning_vitscale.checkpoint.storage import DCP_METADATA, Location
from lightning_vitscale.row_layout import PackedRows

META = METADATA_FILENAME
PARTIAL_SUFFIX = ".partial"
PathLike = str | os.PathLike
EMA_KEY = "ema_state_dict"


def partial_path(location: Location) -> Location:
    return location.with_suffix(PARTIAL_SUFFIX)


def is_own_entry(key: str) -> bool:
    """The model's and the optimizers' entries of a sharded checkpoint (``state_dict``, ``optimizer_<i>``)."""
    return re.fullmatch(r"state_dict|optimizer_\d+", key) is not None


def pop_sharded_entries(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Top-level entries holding DTensors: DCP writes them (a ``torch.save`` keeps rank 0's shards only)."""
    sharded = [key for key, value in checkpoint.items() if any(isinstance(v, DTensor) for v in tree_leaves(value))]
    return {key: checkpoint.pop(key) for key in sharded}


@dataclass(frozen=True)
class ShardedEntry:
    """An extra entry of a sharded checkpoint, left in the shards: only its owner (``ShardedEMA``) has targets
    sharded for this world size, and calls :meth:`load_into` with them on every rank (a collective)."""

    location: Location
    key: str
    weights_only: bool | None = None
    packed: PackedRows = field(default_factory=dict)

    def names(self) -> set[str]:
        metadata = read_metadata(self.location, self.weights_only)
        prefix = self.key + "."
        return {k[len(prefix) :] for k in metadata.state_dict_metadata if k.startswith(prefix)}

    def load_into(self, targets: dict[str, Any]) -> None:
        """Fill ``targets`` (same keys as saved; DTensors of any sharding) in place from the shards."""
        load_into({self.key: targets}, self.location, self.weights_only, packed=self.packed)


def sharded_entries(
    location: Location, weights_only: bool | None = None, packed: PackedRows | None = None
) -> dict[str, ShardedEntry]:
    """The extra DCP entries of a sharded checkpoint (all but ``state_dict`` and ``optimizer_<i>``)."""
    keys = sorted({k.split(".", 1)[0] for k in read_metadata(location, weights_only).state_dict_metadata})
    return {key: ShardedEntry(location, key, weights_only, dict(packed or {})) for key in keys if not is_own_entry(key)}


def checkpoint_shapes(path: PathLike, weights_only: bool | None = None) -> dict[str, torch.Size]:
    """Model tensor shapes recorded in a checkpoint (sharded folder or full file), without loading tensors."""
    location = Location.of(path)
    require_existing(location)
    if location.is_dir():
        return sharded_shapes(location, weights_only)
    return {k: v.shape for k, v in load_full(location, weights_only)["state_dict"].items() if torch.is_tensor(v)}


def require_existing(location: Location) -> None:
    if not location.exists():
        partial = partial_path(location)
        hint = f" An interrupted save left {partial}; it is incomplete and cannot be loaded."
        raise FileNotFoundError(f"No checkpoint at {location}.{hint if partial.exists() else ''}")


def sharded_shapes(location: Location, weights_only: bool | None = None) -> dict[str, torch.Size]:
    """The model's tensor shapes in a complete sharded folder, or a ``CheckpointError`` saying what it is instead."""
    require_existing(location)
    if not location.is_dir():
        raise CheckpointError(
            f"{location} is a single file, not a sharded checkpoint folder: it needs no consolidation (torch.load"
            " and MyModule.load_from_checkpoint read it as it is). Pass the folder VitScaleStrategy saved."
        )
    names = location.names()
    started = any(n.endswith(".distcp") for n in names) or DCP_METADATA in names
    complete = DCP_METADATA in names and META in names
    uncommitted = location.url.rstrip("/").endswith(PARTIAL_SUFFIX) and why_incomplete(location, False) is not None
    if uncommitted or (started and not complete):  # a committed .partial (publish interrupted) is complete
        raise CheckpointError(
            f"{location} is an incomplete sharded checkpoint (missing {DCP_METADATA} or {META}): its save was"
            " interrupted. Resume from an earlier checkpoint."
        )
    if not started:
        raise CheckpointError(
            f"{location} is a folder but not a checkpoint (no DCP shards, no {DCP_METADATA}). Pass the folder that"
            " trainer.save_checkpoint() or ModelCheckpoint wrote, or a single .ckpt file."
        )
    metadata = read_metadata(location, weights_only).state_dict_metadata
    return {key.removeprefix("state_dict."): meta.size for key, meta in metadata.items()
            if key.startswith("state_dict.") and isinstance(meta, TensorStorageMetadata)}


def load_full(location: Location, weights_only: bool | None) -> dict[str, Any]:
    """One ``torch.save`` file; ``weights_only=None`` is torch's default (True), as under DDP."""
    checkpoint = load_pickle(location, weights_only, mmap=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{location} is not a Lightning checkpoint: it has no 'state_dict'.")
    return checkpoint


def require_match(
    expected: dict[str, torch.Size], found: dict[str, torch.Size], what: str, fix: str = "", strict: bool = True
) -> None:
    """A ``CheckpointError`` "``what``: <the missing and unexpected keys (``strict``) and other shapes of ``found``,
    five of each>. ``fix``", unless it matches ``expected``."""
    missing = sorted(expected.keys() - found.keys()) if strict else []
    unexpected = sorted(found.keys() - expected.keys()) if strict else []
    shapes = sorted(f"{k}: checkpoint {tuple(found[k])} vs model {tuple(expected[k])}"
                    for k in expected.keys() & found.keys() if tuple(found[k]) != tuple(expected[k]))
    problems = [("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)]
    detail = "; ".join(f"{label} ({len(items)}): {', '.join(items[:5])}" for label, items in problems if items)
    if detail:
        raise CheckpointError(f"{what}: {detail}. {fix}".rstrip())


def model_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Global shapes of the module's state (DTensors report their unsharded shape)."""
    return {k: v.shape for k, v in module.state_dict().items() if torch.is_tensor(v)}


def as_full(value: Any, dtype: torch.dtype | None) -> Any:
    """A DTensor gathered (in one process: its whole value), floating tensors cast to ``dtype`` unless ``None``."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if torch.is_tensor(value) and dtype is not None and value.is_floating_point():
        return value.to(dtype)
    return value
