"""A sharded checkpoint as one ``torch.save`` file (or the dict it holds, or its bytes in memory), in one process
with no process group: what ``python -m lightning_vitscale consolidate``, ``load_from_checkpoint`` and
``VitScaleCheckpointIO`` read."""

from __future__ import annotations

import io
import os
import posixpath
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.formats import (
    EMA_KEY,
    META,
    PARTIAL_SUFFIX,
    PathLike,
    as_full,
    is_own_entry,
    sharded_shapes,
)
from lightning_vitscale.checkpoint.manifest import verify as verify_folder
from lightning_vitscale.checkpoint.optimizer_state import to_torch_format
from lightning_vitscale.checkpoint.safe_reading import load_all, load_member
from lightning_vitscale.checkpoint.storage import Location, torch_save


def consolidate_command(path: PathLike) -> str:
    """The exact command that turns the sharded folder ``path`` into one file ``load_from_checkpoint`` reads."""
    src = os.fspath(path).rstrip("/")
    stem = src[: -len(".ckpt")] if src.endswith(".ckpt") else src
    return f"python -m lightning_vitscale consolidate {src} {stem}.consolidated.ckpt"


def consolidate_checkpoint(
    src: PathLike,
    dst: PathLike,
    dtype: torch.dtype | None = torch.float32,
    weights_only: bool | None = None,
    weights: Literal["raw", "ema"] = "raw",
    verify: bool = True,
) -> PathLike:
    """Turn a sharded checkpoint into one ``torch.save`` file a plain LightningModule loads with ``strict=True``.

    Runs in one process, no process group. Model keys are free of wrapper/compile prefixes and floating
    tensors are full ``dtype`` tensors (``None`` keeps the saved dtypes). Optimizer states are renumbered to
    torch's native format, so the file also resumes training under ``strategy="ddp"`` (with its EMA, if any) and
    ``MyModule.load_from_checkpoint(dst)`` reads it. ``weights_only`` applies to every pickle in ``src``
    (``None``: torch's default, True); pass ``False`` only for checkpoints you trust. Paths may be fsspec URLs.
    ``weights="ema"`` puts the EMA of the weights (``ShardedEMA``) in ``state_dict`` instead: a file for
    inference or fine-tuning, without optimizer states, so that resuming from it fails instead of silently
    training on from the average. ``verify=False`` skips the CRC-32 check (:func:`load_consolidated`).
    """
    require_file_target(dst)
    checkpoint = load_consolidated(src, dtype=dtype, weights_only=weights_only, weights=weights, verify=verify)
    return write_file(checkpoint, dst)


def consolidated(src: PathLike, weights_only: bool | None = None, verify: bool = True) -> io.BytesIO:
    """The consolidated file of the sharded folder ``src``, in memory, with the saved dtypes (what DDP's file holds):
    ``MyModule.load_from_checkpoint(consolidated(folder))`` loads it in any script, like DDP's file. ``weights_only``
    and ``verify`` as in :func:`load_consolidated` (pass the same ``weights_only`` to ``load_from_checkpoint``).
    Holds the checkpoint twice in host memory while it is read; :func:`consolidate_checkpoint` writes a file."""
    buffer = io.BytesIO()
    torch.save(load_consolidated(src, weights_only=weights_only, verify=verify), buffer)
    buffer.seek(0)
    return buffer


def require_file_target(dst: PathLike) -> None:
    """Fail before reading anything when ``dst`` is an existing folder: fsspec's move would put the file inside
    it, under the temporary name."""
    target = Location.of(dst)
    if target.is_dir():
        raise IsADirectoryError(
            f"{dst} is an existing folder; consolidate writes one file. Name it, e.g. {target.child('model.ckpt')}"
        )


def write_file(checkpoint: dict[str, Any], dst: PathLike) -> PathLike:
    """``torch.save`` to a temporary name beside ``dst``, then moved: an interrupted write leaves no ``dst``."""
    target = Location.of(dst)
    target.fs.makedirs(posixpath.dirname(target.path), exist_ok=True)
    tmp = target.with_suffix(PARTIAL_SUFFIX)
    torch_save(checkpoint, tmp)
    tmp.move_to(target)
    return dst if target.is_url else Path(dst)


def load_consolidated(
    src: PathLike,
    dtype: torch.dtype | None = None,
    weights_only: bool | None = None,
    weights: Literal["raw", "ema"] = "raw",
    verify: bool = True,
) -> dict[str, Any]:
    """The checkpoint dict :func:`consolidate_checkpoint` writes, in memory: what ``torch.load`` of DDP's file
    returns (plain keys, full CPU tensors, torch-native optimizer states, Lightning's metadata). One process, no
    process group; ``weights_only`` and ``weights`` as in :func:`consolidate_checkpoint`. ``dtype=None`` (the
    default here) keeps the saved dtypes, as a ``state_dict_type="full"`` file holds them. ``verify``: every file
    checked against the CRC-32 its save recorded first (``manifest.verify``; benchmarks/RESULTS.md: the cost), so a
    corrupt shard fails naming itself instead of handing out wrong weights; ``False`` only for a folder you must
    read despite a damaged file.

    ``optimizer_states`` is present only when the save had them (Lightning writes it together with
    ``lr_schedulers``): a weights-only save then fails a resumed fit with Lightning's own error, as under DDP,
    instead of resuming the weights with fresh optimizers."""
    source = Location.of(src)
    sharded_shapes(source, weights_only)  # complete and readable, or a clear error
    if verify:
        verify_folder(source, required=False)  # folders written without a manifest have nothing to check
    if weights not in ("raw", "ema"):
        raise ValueError(f"`weights` must be 'raw' or 'ema'; got {weights!r}.")
    state = load_all(source, weights_only)
    checkpoint = load_member(source, META, weights_only)
    checkpoint["state_dict"] = _plain_keys(state.pop("state_dict"), dtype)
    optimizers = [state.pop(k) for k in sorted((k for k in state if is_own_entry(k)), key=_index)]
    if optimizers or "lr_schedulers" in checkpoint:
        checkpoint["optimizer_states"] = [to_torch_format(o) for o in optimizers]
    checkpoint.update({key: _plain_keys(entry, dtype) for key, entry in state.items()})
    if weights == "ema":
        ema_as_weights(checkpoint, source.url)
    return checkpoint


def _plain_keys(entry: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    return {strip_wrapper_prefixes(key): as_full(value, dtype) for key, value in entry.items()}


def ema_as_weights(checkpoint: dict[str, Any], src: str) -> None:
    """Replace ``state_dict`` by the ``ShardedEMA`` average (keys it lacks keep the raw value), drop the optimizers."""
    ema = checkpoint.pop(EMA_KEY, None)
    if ema is None:
        raise CheckpointError(
            f"{src} holds no EMA of the weights (it was saved without the ShardedEMA callback)."
            " Export the raw weights with `--weights raw` (`export`: `--weights model`), or train with"
            " `callbacks=[ShardedEMA()]`."
        )
    checkpoint["state_dict"] = {k: ema.get(k, v) for k, v in checkpoint["state_dict"].items()}
    checkpoint.pop("optimizer_states", None)
    checkpoint.pop("lr_schedulers", None)


def _index(key: str) -> int:
    return int(key.split("_")[-1])
