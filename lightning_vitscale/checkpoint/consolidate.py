"""A sharded checkpoint as one ``torch.save`` file (or the dict it holds, or its bytes in memory), in one process
with no process group."""

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
from lightning_vitscale.checkpoint.storage import Location


def consolidate_command(path: PathLike) -> str:
    """The exact command that turns the sharded folder ``path`` into one file ``load_from_checkpoint`` reads."""
    src = os.fspath(path).rstrip("/")
    stem = src[: -len(".ckpt")] if src.endswith(".ckpt") else src
    return f"python -m lightning_vitscale consolidate {src} {stem}.consolidated.ckpt"


def consolidate_checkpoint(
    src: PathLike, dst: PathLike, dtype: torch.dtype | None = torch.float32, weights_only: bool | None = None,
    weights: Literal["raw", "ema"] = "raw", verify: bool = True,
) -> PathLike:
    """Turn a sharded checkpoint into one ``torch.save`` file, as DDP's: ``MyModule.load_from_checkpoint(dst)``
    reads it and a ``strategy="ddp"`` run resumes from it. One process, no process group; paths may be fsspec URLs.

    Args:
        dtype: floating tensors' dtype; ``None`` keeps the saved dtypes.
        weights_only: for every pickle in ``src`` (``None``: torch's default, True); ``False`` only if trusted.
        weights: ``"ema"`` puts ``ShardedEMA``'s average in ``state_dict`` and drops the optimizer states (resuming
            from it fails instead of silently training on from the average).
        verify: check every file's CRC-32 first (:func:`load_consolidated`).
    """
    require_file_target(dst)
    checkpoint = load_consolidated(src, dtype=dtype, weights_only=weights_only, weights=weights, verify=verify)
    return write_file(checkpoint, dst)


def consolidated(src: PathLike, weights_only: bool | None = None, verify: bool = True) -> io.BytesIO:
    """The consolidated file of ``src`` in memory, saved dtypes kept, for ``MyModule.load_from_checkpoint(
    consolidated(folder))`` (same ``weights_only``); holds the checkpoint twice in host memory while read."""
    buffer = io.BytesIO()
    torch.save(load_consolidated(src, weights_only=weights_only, verify=verify), buffer)
    buffer.seek(0)
    return buffer


def require_file_target(dst: PathLike) -> None:
    """Fail before reading when ``dst`` is a folder (fsspec's move would put the temporary file inside it)."""
    target = Location.of(dst)
    if target.is_dir():
        raise IsADirectoryError(
            f"{dst} is an existing folder; this command writes one file. Name it, e.g. {target.child('model.ckpt')}"
        )


def write_file(checkpoint: dict[str, Any] | bytes, dst: PathLike) -> PathLike:
    """Atomic: ``torch.save`` of ``checkpoint`` (bytes as they are) beside ``dst``, then moved there."""
    target = Location.of(dst)
    target.fs.makedirs(posixpath.dirname(target.path), exist_ok=True)
    tmp = target.with_suffix(PARTIAL_SUFFIX)
    with tmp.open("wb") as stream:
        if isinstance(checkpoint, bytes):
            stream.write(checkpoint)
        else:
            torch.save(checkpoint, stream)
    tmp.move_to(target)
    return dst if target.is_url else Path(dst)


def load_consolidated(
    src: PathLike, dtype: torch.dtype | None = None, weights_only: bool | None = None,
    weights: Literal["raw", "ema"] = "raw", verify: bool = True,
) -> dict[str, Any]:
    """The dict :func:`consolidate_checkpoint` writes, as ``torch.load`` of DDP's file returns it. ``verify``: a
    corrupt shard fails naming itself, never wrong weights (cost: benchmarks/RESULTS.md). ``optimizer_states`` only
    when the save had them (or ``lr_schedulers``): resuming a weights-only save fails as under DDP."""
    source = Location.of(src)
    sharded_shapes(source, weights_only)  # complete and readable, or a clear error
    if verify:
        verify_folder(source, required=False)  # folders written without a manifest have nothing to check
    if weights not in ("raw", "ema"):
        raise ValueError(f"`weights` must be 'raw' or 'ema'; got {weights!r}.")
    state = load_all(source, weights_only)
    checkpoint = load_member(source, META, weights_only)
    checkpoint["state_dict"] = _plain_keys(state.pop("state_dict"), dtype)
    optimizers = [state.pop(k) for k in sorted((k for k in state if is_own_entry(k)), key=lambda k: int(k[10:]))]
    if optimizers or "lr_schedulers" in checkpoint:
        checkpoint["optimizer_states"] = [to_torch_format(o) for o in optimizers]
    checkpoint.update({key: _plain_keys(entry, dtype) for key, entry in state.items()})
    if weights == "ema":
        ema_as_weights(checkpoint, source.url)
    return checkpoint


def _plain_keys(entry: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    return {strip_wrapper_prefixes(key): as_full(value, dtype) for key, value in entry.items()}


def ema_as_weights(checkpoint: dict[str, Any], src: str) -> None:
    """``state_dict`` replaced by ``ShardedEMA``'s average (keys it lacks stay raw), the optimizers dropped."""
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
