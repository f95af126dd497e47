"""Sharded checkpoints: atomic DCP saves, validated loads (any world size, DDP files too), single-file export."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_vitscale._compat import METADATA_FILENAME as META
from lightning_vitscale._compat import DTensor, EmptyStateDictLoadPlanner, dcp_load_into

PARTIAL_SUFFIX = ".partial"
DCP_METADATA = ".metadata"
_STRIP = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_forward_module.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; the message names the path and what is wrong."""


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def is_complete_sharded(path: Path) -> bool:
    """Complete means both DCP's metadata (written after every rank's shards) and Lightning's (written last)."""
    return path.is_dir() and (path / DCP_METADATA).is_file() and (path / META).is_file()


def save_sharded(
    tensors: dict[str, Any], metadata: dict[str, Any], path: Path, is_rank_zero: bool, barrier: Callable[[], None]
) -> None:
    """Every rank writes its own shards into ``<path>.partial``; rank 0 then writes Lightning's metadata and
    swaps the folder into place. A crash at any point leaves ``path`` as it was (the previous checkpoint stays
    loadable) and a ``.partial`` folder that never loads as if complete."""
    staging = partial_path(path)
    if is_rank_zero and staging.exists():
        shutil.rmtree(staging)
    barrier()
    dcp.save(tensors, checkpoint_id=staging)  # collective; coordinator writes .metadata after all shards
    if is_rank_zero:
        torch.save(metadata, staging / META)
        _swap_into_place(staging, path)
    barrier()


def _swap_into_place(staging: Path, path: Path) -> None:
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if path.exists():
        path.rename(old)
    staging.rename(path)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


_OWN_ENTRY = re.compile(r"^(state_dict|optimizer_\d+)$")
EMA_KEY = "ema_state_dict"


def pop_sharded_entries(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Top-level checkpoint entries holding DTensors (e.g. ``ema_state_dict``): they must go through DCP, since
    rank 0's ``torch.save`` of the metadata would keep rank 0's shards only."""
    sharded = [key for key, value in checkpoint.items() if _holds_dtensor(value)]
    return {key: checkpoint.pop(key) for key in sharded}


def _holds_dtensor(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_dtensor(v) for v in value)
    return isinstance(value, DTensor)


@dataclass(frozen=True)
class ShardedEntry:
    """A top-level entry of a sharded checkpoint other than the model and optimizers, left in the DCP shards.

    Loading needs target DTensors sharded for *this* world size, which only the entry's owner has (e.g.
    ``ShardedEMA``): the owner calls :meth:`load_into` on every rank (a collective) with its own tensors.
    """

    path: Path
    key: str

    def names(self) -> set[str]:
        metadata = FileSystemReader(str(self.path)).read_metadata()
        prefix = self.key + "."
        return {k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix)}

    def load_into(self, targets: dict[str, Any]) -> None:
        """Fill ``targets`` (same keys as saved; DTensors of any sharding) in place from the shards."""
        dcp.load({self.key: targets}, checkpoint_id=self.path)


def sharded_entries(path: Path) -> dict[str, ShardedEntry]:
    """The extra DCP entries of a sharded checkpoint (everything but ``state_dict`` and ``optimizer_<i>``)."""
    metadata = FileSystemReader(str(path)).read_metadata()
    keys = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}
    return {key: ShardedEntry(Path(path), key) for key in sorted(keys) if not _OWN_ENTRY.match(key)}


def checkpoint_shapes(path: Path) -> dict[str, torch.Size]:
    """Model tensor shapes recorded in a checkpoint (sharded folder or full file), without loading tensors."""
    path = Path(path)
    if not path.exists():
        partial = partial_path(path)
        hint = (
            f" An interrupted save left {partial}; it is incomplete and cannot be loaded." if partial.exists() else ""
        )
        raise FileNotFoundError(f"No checkpoint at {path}.{hint}")
    if path.is_dir():
        return _sharded_shapes(path)
    return {k: v.shape for k, v in _load_full(path).get("state_dict", {}).items() if torch.is_tensor(v)}


def _sharded_shapes(path: Path) -> dict[str, torch.Size]:
    if not any(path.glob("*.distcp")) and not (path / DCP_METADATA).exists():
        raise CheckpointError(
            f"{path} is a folder but not a checkpoint (no DCP shards, no {DCP_METADATA}). Pass the folder that"
            " trainer.save_checkpoint() or ModelCheckpoint wrote, or a single .ckpt file."
        )
    if path.name.endswith(PARTIAL_SUFFIX) or not (path / DCP_METADATA).is_file() or not (path / META).is_file():
        raise CheckpointError(
            f"{path} is an incomplete sharded checkpoint (missing {DCP_METADATA} or {META}): its save was"
            " interrupted. Resume from an earlier checkpoint."
        )
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unreadable metadata means the same thing to the user
        raise CheckpointError(f"{path} is not a readable checkpoint: {error}") from error
    prefix = "state_dict."
    return {
        key[len(prefix) :]: meta.size
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def _load_full(path: Path) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"{path} is not a readable checkpoint file (truncated or foreign?): {error}") from error
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path} is not a Lightning checkpoint: it has no 'state_dict'.")
    return checkpoint


def validate_against(path: Path, expected: dict[str, torch.Size], strict: bool = True) -> None:
    """Raise a CheckpointError listing missing/unexpected keys and shape mismatches, before any collective."""
    found = checkpoint_shapes(path)
    missing = sorted(expected.keys() - found.keys()) if strict else []
    unexpected = sorted(found.keys() - expected.keys()) if strict else []
    shapes = sorted(
        f"{k}: checkpoint {tuple(found[k])} vs model {tuple(expected[k])}"
        for k in expected.keys() & found.keys()
        if tuple(found[k]) != tuple(expected[k])
    )
    problems = [(label, items) for label, items in (("missing", missing), ("unexpected", unexpected),
                                                     ("shape mismatch", shapes)) if items]
    if problems:
        detail = "; ".join(f"{label} ({len(items)}): {', '.join(items[:5])}" for label, items in problems)
        raise CheckpointError(f"Checkpoint {path} does not match the model: {detail}.")


def model_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Global shapes of the module's state (DTensors report their unsharded shape)."""
    return {k: v.shape for k, v in module.state_dict().items() if torch.is_tensor(v)}


def rekey_by_position(optimizer_state: dict[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module):
    """torch-native optimizer state (params numbered across groups) -> keyed by parameter name, as DCP wants.

    Numbers follow the optimizer's own parameter order, which is how torch assigned them when the checkpoint
    was written by the same `configure_optimizers` (robust to param groups, unlike `model.parameters()` order).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {order[i] if isinstance(i, int) else i: v for i, v in optimizer_state["state"].items()}
    groups = [{**g, "params": [order[i] if isinstance(i, int) else i for i in g["params"]]}
              for g in optimizer_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_full_into(path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool):
    """Load a single-file checkpoint (e.g. written under DDP) into a sharded module; returns the rest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    checkpoint = _load_full(path)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        set_optimizer_state_dict(module, optimizer, rekey_by_position(state, optimizer, module), options=options)
    return checkpoint


def _clean_key(key: str) -> str:
    for marker in _STRIP:
        key = key.replace(marker, "")
    return key


def _full(value: Any, dtype: torch.dtype | None) -> Any:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if torch.is_tensor(value) and dtype is not None and value.is_floating_point():
        return value.to(dtype)
    return value


def consolidate_checkpoint(
    src: str | Path, dst: str | Path, dtype: torch.dtype | None = torch.float32, weights: Literal["raw", "ema"] = "raw"
) -> Path:
    """Turn a sharded checkpoint into one ``torch.save`` file a plain LightningModule loads with ``strict=True``.

    Runs in one process, no process group. Model keys are free of wrapper/compile prefixes and floating
    tensors are full ``dtype`` tensors (``None`` keeps the saved dtypes). Optimizer states are renumbered to
    torch's native format, so the file also resumes training under ``strategy="ddp"`` (with its EMA, if any).
    ``weights="ema"`` puts the EMA of the weights (``ShardedEMA``) in ``state_dict`` instead: a file for
    inference or fine-tuning, without optimizer states, so that resuming from it fails instead of silently
    training on from the average.
    """
    src, dst = Path(src), Path(dst)
    _sharded_shapes(src)  # complete and readable, or a clear error
    state: dict[str, Any] = {}
    dcp_load_into(state, storage_reader=FileSystemReader(str(src)), planner=EmptyStateDictLoadPlanner(), no_dist=True)
    checkpoint = torch.load(src / META, weights_only=False)
    checkpoint["state_dict"] = {_clean_key(k): _full(v, dtype) for k, v in state.pop("state_dict").items()}
    optimizers = [state.pop(k) for k in sorted((k for k in state if _OWN_ENTRY.match(k)), key=_index)]
    checkpoint["optimizer_states"] = [_to_torch_format(o) for o in optimizers]
    checkpoint.update({key: {_clean_key(k): _full(v, dtype) for k, v in entry.items()} for key, entry in state.items()})
    if weights == "ema":
        _ema_as_weights(checkpoint, src)
    elif weights != "raw":
        raise ValueError(f"`weights` must be 'raw' or 'ema'; got {weights!r}.")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + PARTIAL_SUFFIX)
    torch.save(checkpoint, tmp)
    tmp.replace(dst)
    return dst


def _ema_as_weights(checkpoint: dict[str, Any], src: Path) -> None:
    ema = checkpoint.pop(EMA_KEY, None)
    if ema is None:
        raise CheckpointError(
            f"{src} holds no EMA of the weights (it was saved without the ShardedEMA callback)."
            " Export the raw weights with `--weights raw`, or train with `callbacks=[ShardedEMA()]`."
        )
    checkpoint["state_dict"] = {k: ema.get(k, v) for k, v in checkpoint["state_dict"].items()}
    checkpoint.pop("optimizer_states")
    checkpoint.pop("lr_schedulers", None)


def _index(key: str) -> int:
    return int(key.split("_")[-1])


def _to_torch_format(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    return {
        "state": {number[name]: {k: _full(v, None) for k, v in s.items()}
                  for name, s in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in optimizer_state["param_groups"]],
    }
