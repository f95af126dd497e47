"""Checkpoint formats: what a sharded folder or a full file holds, validation before loading, single-file export."""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_vitscale._compat import METADATA_FILENAME, DTensor, dcp_load_into
from lightning_vitscale.checkpoint_storage import (
    DCP_METADATA,
    Location,
    SafeEmptyLoadPlanner,
    torch_load,
    torch_save,
)

META = METADATA_FILENAME
PARTIAL_SUFFIX = ".partial"
_STRIP = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_forward_module.")
PathLike = str | os.PathLike


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; the message names the path and what is wrong."""


def partial_path(location: Location) -> Location:
    return location.with_suffix(PARTIAL_SUFFIX)


def consolidate_command(path: PathLike) -> str:
    """The exact command that turns the sharded folder ``path`` into one file ``load_from_checkpoint`` reads."""
    src = os.fspath(path).rstrip("/")
    stem = src[: -len(".ckpt")] if src.endswith(".ckpt") else src
    return f"python -m lightning_vitscale consolidate {src} {stem}.consolidated.ckpt"


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

    location: Location
    key: str
    weights_only: bool | None = None

    @property
    def path(self) -> str:
        return self.location.url

    def names(self) -> set[str]:
        metadata = self.location.reader(self.weights_only).read_metadata()
        prefix = self.key + "."
        return {k[len(prefix) :] for k in metadata.state_dict_metadata if k.startswith(prefix)}

    def load_into(self, targets: dict[str, Any]) -> None:
        """Fill ``targets`` (same keys as saved; DTensors of any sharding) in place from the shards."""
        with refused_values_named(self.location):
            dcp.load({self.key: targets}, storage_reader=self.location.reader(self.weights_only))


def sharded_entries(location: Location, weights_only: bool | None = None) -> dict[str, ShardedEntry]:
    """The extra DCP entries of a sharded checkpoint (everything but ``state_dict`` and ``optimizer_<i>``)."""
    metadata = location.reader(weights_only).read_metadata()
    keys = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}
    return {key: ShardedEntry(location, key, weights_only) for key in sorted(keys) if not _OWN_ENTRY.match(key)}


def checkpoint_shapes(path: PathLike, weights_only: bool | None = None) -> dict[str, torch.Size]:
    """Model tensor shapes recorded in a checkpoint (sharded folder or full file), without loading tensors."""
    location = Location.of(path)
    if not location.exists():
        partial = partial_path(location)
        hint = (
            f" An interrupted save left {partial}; it is incomplete and cannot be loaded." if partial.exists() else ""
        )
        raise FileNotFoundError(f"No checkpoint at {location}.{hint}")
    if location.is_dir():
        return sharded_shapes(location, weights_only)
    checkpoint = load_full(location, weights_only)
    return {k: v.shape for k, v in checkpoint.get("state_dict", {}).items() if torch.is_tensor(v)}


def sharded_shapes(location: Location, weights_only: bool | None = None) -> dict[str, torch.Size]:
    names = location.names()
    if not any(n.endswith(".distcp") for n in names) and DCP_METADATA not in names:
        raise CheckpointError(
            f"{location} is a folder but not a checkpoint (no DCP shards, no {DCP_METADATA}). Pass the folder that"
            " trainer.save_checkpoint() or ModelCheckpoint wrote, or a single .ckpt file."
        )
    if location.url.rstrip("/").endswith(PARTIAL_SUFFIX) or DCP_METADATA not in names or META not in names:
        raise CheckpointError(
            f"{location} is an incomplete sharded checkpoint (missing {DCP_METADATA} or {META}): its save was"
            " interrupted. Resume from an earlier checkpoint."
        )
    try:
        metadata = location.reader(weights_only).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unreadable metadata means the same thing to the user
        raise CheckpointError(f"{location} is not a readable checkpoint: {error}") from error
    prefix = "state_dict."
    return {
        key[len(prefix) :]: meta.size
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def load_full(location: Location, weights_only: bool | None) -> dict[str, Any]:
    """One ``torch.save`` file; ``weights_only=None`` is torch's default (True), as under DDP."""
    checkpoint = load_pickle(location, weights_only, mmap=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{location} is not a Lightning checkpoint: it has no 'state_dict'.")
    return checkpoint


def load_pickle(location: Location, weights_only: bool | None, mmap: bool = False) -> Any:
    """``torch.load`` whose failure says whether the file is unreadable or holds objects weights_only refuses."""
    try:
        return torch_load(location, weights_only, mmap=mmap)
    except Exception as error:  # noqa: BLE001
        unsafe = _unsafe_globals(location)
        if unsafe:
            raise CheckpointError(
                f"{location} holds objects that loading with weights_only=True refuses ({', '.join(unsafe[:5])})."
                " Only if you trust this file: pass weights_only=False (e.g. trainer.fit(model, ckpt_path=...,"
                " weights_only=False)), or allow the classes with torch.serialization.add_safe_globals([...])."
            ) from error
        raise CheckpointError(
            f"{location} is not a readable checkpoint file (truncated or foreign?): {error}"
        ) from error


def _unsafe_globals(location: Location) -> list[str]:
    """Names a weights-only load refuses in a readable file (empty for garbage); scans, never executes."""
    try:
        with location.open("rb") as stream:
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(stream))
    except Exception:  # noqa: BLE001 - not a torch.save zip file at all
        return []


@contextmanager
def refused_values_named(location: Location) -> Iterator[None]:
    """DCP re-raises a rank's failure as a ``CheckpointException`` on every rank; name the path and the fix when
    the failure is a value that weights_only loading refused."""
    try:
        yield
    except CheckpointException as error:
        if "Weights only load failed" not in str(error):
            raise
        raise CheckpointError(
            f"{location} holds a value that loading with weights_only=True refuses: {error}. Only if you trust"
            " this checkpoint: pass weights_only=False (CLI: `python -m lightning_vitscale consolidate --unsafe`)."
        ) from error


def validate_against(
    path: PathLike, expected: dict[str, torch.Size], strict: bool = True, weights_only: bool | None = None
) -> None:
    """Raise a CheckpointError listing missing/unexpected keys and shape mismatches, before any collective."""
    found = checkpoint_shapes(path, weights_only)
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


def load_full_into(
    path: PathLike,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a single-file checkpoint (e.g. written under DDP) into a sharded module; returns the rest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    checkpoint = load_full(Location.of(path), weights_only)
    require_optimizer_states("optimizer_states" in checkpoint, optimizers)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        set_optimizer_state(module, optimizer, rekey_by_position(state, optimizer, module), options)
    return checkpoint


def require_optimizer_states(present: bool, optimizers: list[torch.optim.Optimizer]) -> None:
    """Resuming a fit from a weights-only checkpoint fails under DDP with this KeyError; so it does here."""
    if optimizers and not present:
        raise KeyError(
            "Trying to restore optimizer state but checkpoint contains only the model."
            " This is probably due to `ModelCheckpoint.save_weights_only` being set to `True`."
        )


@contextmanager
def untouched_if_fresh(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """torch's optimizer state-dict functions initialise an optimizer that has never stepped by running a step
    with zero gradients (Adam's step count becomes 1, so the first real step is bias-corrected as the second).
    Under DDP a save before the first step (``lr_find`` does one) changes nothing: clear that state again."""
    fresh = not optimizer.state
    try:
        yield fresh
    finally:
        if fresh:
            optimizer.state.clear()


def set_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], options) -> None:
    """Like ``optimizer.load_state_dict`` under DDP: the saved param groups replace the current ones (keys added
    since the save, such as a scheduler's ``initial_lr``, go), and a state saved before the first step stays empty."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if state["state"]:
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=options)
        return
    if len(state["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"The checkpoint's optimizer has {len(state['param_groups'])} param groups, this one"
            f" {len(optimizer.param_groups)}: configure_optimizers must build the groups it was saved with."
        )
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        params = group["params"]
        group.clear()
        group.update({k: v for k, v in saved.items() if k != "params"}, params=params)
    optimizer.state.clear()


def clean_key(key: str) -> str:
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
    src: PathLike,
    dst: PathLike,
    dtype: torch.dtype | None = torch.float32,
    weights_only: bool | None = None,
    weights: Literal["raw", "ema"] = "raw",
) -> PathLike:
    """Turn a sharded checkpoint into one ``torch.save`` file a plain LightningModule loads with ``strict=True``.

    Runs in one process, no process group. Model keys are free of wrapper/compile prefixes and floating
    tensors are full ``dtype`` tensors (``None`` keeps the saved dtypes). Optimizer states are renumbered to
    torch's native format, so the file also resumes training under ``strategy="ddp"`` (with its EMA, if any) and
    ``MyModule.load_from_checkpoint(dst)`` reads it. ``weights_only`` applies to every pickle in ``src``
    (``None``: torch's default, True); pass ``False`` only for checkpoints you trust. Paths may be fsspec URLs.
    ``weights="ema"`` puts the EMA of the weights (``ShardedEMA``) in ``state_dict`` instead: a file for
    inference or fine-tuning, without optimizer states, so that resuming from it fails instead of silently
    training on from the average.
    """
    checkpoint = load_consolidated(src, dtype=dtype, weights_only=weights_only, weights=weights)
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
) -> dict[str, Any]:
    """The checkpoint dict :func:`consolidate_checkpoint` writes, in memory: what ``torch.load`` of DDP's file
    returns (plain keys, full CPU tensors, torch-native optimizer states, Lightning's metadata). One process, no
    process group; ``weights_only`` and ``weights`` as in :func:`consolidate_checkpoint`. ``dtype=None`` (the
    default here) keeps the saved dtypes, as a ``state_dict_type="full"`` file holds them.

    ``optimizer_states`` is present only when the save had them (Lightning writes it together with
    ``lr_schedulers``): a weights-only save then fails a resumed fit with Lightning's own error, as under DDP,
    instead of resuming the weights with fresh optimizers."""
    source = Location.of(src)
    sharded_shapes(source, weights_only)  # complete and readable, or a clear error
    state: dict[str, Any] = {}
    if weights not in ("raw", "ema"):
        raise ValueError(f"`weights` must be 'raw' or 'ema'; got {weights!r}.")
    reader = source.reader(weights_only)
    with refused_values_named(source):
        dcp_load_into(state, storage_reader=reader, planner=SafeEmptyLoadPlanner(weights_only), no_dist=True)
    checkpoint = load_pickle(source.child(META), weights_only)
    checkpoint["state_dict"] = {clean_key(k): _full(v, dtype) for k, v in state.pop("state_dict").items()}
    optimizers = [state.pop(k) for k in sorted((k for k in state if _OWN_ENTRY.match(k)), key=_index)]
    if optimizers or "lr_schedulers" in checkpoint:
        checkpoint["optimizer_states"] = [to_torch_format(o) for o in optimizers]
    checkpoint.update({key: {clean_key(k): _full(v, dtype) for k, v in entry.items()} for key, entry in state.items()})
    if weights == "ema":
        _ema_as_weights(checkpoint, source.url)
    return checkpoint


def _ema_as_weights(checkpoint: dict[str, Any], src: str) -> None:
    ema = checkpoint.pop(EMA_KEY, None)
    if ema is None:
        raise CheckpointError(
            f"{src} holds no EMA of the weights (it was saved without the ShardedEMA callback)."
            " Export the raw weights with `--weights raw`, or train with `callbacks=[ShardedEMA()]`."
        )
    checkpoint["state_dict"] = {k: ema.get(k, v) for k, v in checkpoint["state_dict"].items()}
    checkpoint.pop("optimizer_states", None)
    checkpoint.pop("lr_schedulers", None)


def _index(key: str) -> int:
    return int(key.split("_")[-1])


def to_torch_format(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state keyed by parameter name -> torch's native format (params numbered across groups)."""
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    return {
        "state": {number[name]: {k: _full(v, None) for k, v in s.items()}
                  for name, s in optimizer_state.get("state", {}).items()},
        "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in optimizer_state["param_groups"]],
    }
