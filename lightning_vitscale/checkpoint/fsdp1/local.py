"""FSDP1 ``LOCAL_STATE_DICT`` checkpoints (one ``torch.save`` file per rank, e.g. DINOv2's
``model_0012499.rank_<N>.pth``) as one plain state dict, given the model definition. Each rank's file holds, per
FSDP1 unit, ``<unit>._flat_param``: a ``ShardedTensor`` of that rank's slice of the unit's flattened, padded
parameters (with ``use_orig_params=True`` also each parameter's slice, dropped here), and plain tensors for the
rest. The names and shapes inside a flat parameter come from the model (``flat_layout.py``).
"""

from __future__ import annotations

import fnmatch
import importlib
import posixpath
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint.consolidate import require_file_target, write_file
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.formats import PathLike, as_full, model_shapes, require_match
from lightning_vitscale.checkpoint.fsdp1.flat_layout import choose_alignment, flat_units, offsets, split
from lightning_vitscale.checkpoint.fsdp1.sharded import MODEL_ENTRIES
from lightning_vitscale.checkpoint.fsdp1.sharded_tensor_pickle import (
    LocalShards,
    ShardedTensorRecord,
    as_local_shards,
    load_local_shards,
)
from lightning_vitscale.checkpoint.storage import Location

FLAT_PARAM_NAMES = ("_flat_param", "flat_param")  # torch >= 2.0; torch 1.12-1.13


def load_fsdp1_local_state_dict(
    src: PathLike, model: nn.Module, dtype: torch.dtype | None = None, weights_only: bool | None = None,
    aligned_numel: int | None = None,
) -> dict[str, torch.Tensor]:
    """The full state dict of FSDP1 ``LOCAL_STATE_DICT`` rank files (``src``: their folder, or a pattern such as
    ``run/model_0012499.rank_*.pth``), keyed as ``model.state_dict()`` of the plain module FSDP1 wrapped (on the
    meta device is enough). ``dtype=None`` keeps the saved dtypes. ``aligned_numel``: FSDP1's alignment when the
    files fit several (0: ``use_orig_params=False``; 4: fp32, 8: bf16/fp16 mixed precision); ``None`` infers it.

    Example::

        state = load_fsdp1_local_state_dict("run/model_0012499.rank_*.pth", build_model())
        build_model().load_state_dict(state, strict=True)
    """
    ranks = _read_ranks(src, weights_only)
    flats, plain = _gather(ranks)
    units = flat_units(model, set(flats))
    # FSDP1 pads to its sharding group's size: the world's, unless it ran hybrid sharding (replicas of each shard)
    group = next(value.group_size for value in ranks[0].values() if isinstance(value, LocalShards))
    alignment = choose_alignment(units, {name: flat.numel() for name, flat in flats.items()}, group, aligned_numel)
    state: dict[str, torch.Tensor] = {}
    for unit in units:
        state.update(split(unit, flats[unit.name], offsets(unit, alignment, group)[0]))
    state.update({key: value for key, value in plain.items() if key not in state})
    expected = model_shapes(model)  # keyed and ordered as model.state_dict(), every shape checked
    shapes = {key: value.shape for key, value in state.items()}
    require_match(expected, shapes, f"{src} does not match the model", "Pass the model FSDP1 wrapped, built alike.")
    return {key: as_full(state[key], dtype) for key in expected}


def convert_fsdp1_local_checkpoint(
    src: PathLike, dst: PathLike, model: nn.Module, dtype: torch.dtype | None = torch.float32,
    weights_only: bool | None = None, aligned_numel: int | None = None,
) -> PathLike:
    """Write ``{"state_dict": ...}`` of :func:`load_fsdp1_local_state_dict` to ``dst``: weights to start from."""
    require_file_target(dst)
    state = load_fsdp1_local_state_dict(src, model, dtype, weights_only, aligned_numel)
    return write_file({"state_dict": state}, dst)


def build_model(spec: str) -> nn.Module:
    """``package.module:callable`` -> the module it builds, on the meta device (names and shapes only)."""
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable[[], Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise CheckpointError(
            f"--model {spec!r}: cannot import it ({error}). Give `package.module:callable`, importable from here,"
            " whose call with no arguments builds the model FSDP1 wrapped."
        ) from error
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"--model {spec!r} returned a {type(model).__name__}, not an nn.Module.")
    return model


def rank_files(src: PathLike) -> list[Location]:
    """A folder's files, those matching a ``*``/``?`` pattern in the last part, or the one file ``src``."""
    folder, pattern = Location.of(src), "*"
    if any(char in posixpath.basename(str(src)) for char in "*?["):
        folder, pattern = Location.of(posixpath.dirname(str(src)) or "."), posixpath.basename(str(src))
    elif folder.is_file():
        return [folder]  # one rank's file: an error below unless the world had one rank
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a folder: no rank files match {src}. Pass the folder of FSDP1 LOCAL_STATE_DICT rank"
            " files or a pattern such as run/model_0012499.rank_*.pth."
        )
    files = [folder.child(n) for n in sorted(fnmatch.filter(folder.names(), pattern)) if folder.child(n).is_file()]
    if not files:
        raise CheckpointError(f"no files match {src}: pass the rank files' folder or a pattern matching them.")
    return files


def _read_ranks(src: PathLike, weights_only: bool | None) -> list[dict[str, Any]]:
    """Each rank's model state dict (flat parameters as :class:`LocalShards`), all ranks, in rank order."""
    by_rank: dict[int, dict[str, Any]] = {}
    world_sizes: set[int] = set()
    for location in rank_files(src):
        model = _model_entry(load_local_shards(location, weights_only), location)
        shards = [value for value in model.values() if isinstance(value, LocalShards)]
        rank = shards[0].rank
        world_sizes.update(shard.world_size for shard in shards)
        if rank in by_rank:
            raise CheckpointError(f"{location} and another file both hold rank {rank}: pass one step's files only.")
        by_rank[rank] = model
    world_size = max(world_sizes)
    if len(world_sizes) > 1 or sorted(by_rank) != list(range(world_size)):
        raise CheckpointError(
            f"{src}: the files hold ranks {sorted(by_rank)} of a world of {sorted(world_sizes)}; FSDP1 wrote one"
            f" file per rank, ranks 0..{world_size - 1}. Pass all of them, from one save."
        )
    return [by_rank[rank] for rank in range(world_size)]


def _model_entry(loaded: Any, location: Location) -> dict[str, Any]:
    """The local state dict in the file (itself, or under ``model``/``state_dict``/``module``), records checked."""
    candidates = [loaded] + [loaded.get(name) for name in MODEL_ENTRIES] if isinstance(loaded, dict) else []
    for entry in candidates:
        if isinstance(entry, dict) and any(isinstance(v, ShardedTensorRecord) for v in entry.values()):
            return {
                key: as_local_shards(value, key) if isinstance(value, ShardedTensorRecord) else value
                for key, value in entry.items()
            }
    top = sorted(loaded)[:8] if isinstance(loaded, dict) else type(loaded).__name__
    raise CheckpointError(
        f"{location} holds no FSDP1 flat parameter (a `_flat_param` ShardedTensor) at its top level or under"
        f" {list(MODEL_ENTRIES)} (found {top}): it is not an FSDP1 LOCAL_STATE_DICT rank file. Pass a pattern"
        " matching only the rank files."
    )


def _gather(ranks: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Each unit's whole flat parameter by the unit's module name, and rank 0's other tensors by plain name."""
    flats: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    for key, value in ranks[0].items():
        name = strip_wrapper_prefixes(key)
        head, _, last = name.rpartition(".")
        if last in FLAT_PARAM_NAMES and isinstance(value, LocalShards):
            flats[head] = _whole(key, [rank[key] for rank in ranks if key in rank])
        elif torch.is_tensor(value):
            plain[name] = value
    return flats, plain


def _whole(key: str, shards: list[LocalShards]) -> torch.Tensor:
    numel, dtype = shards[0].numel, shards[0].dtype
    flat, covered = torch.empty(numel, dtype=dtype), torch.zeros(numel, dtype=torch.bool)
    for shard in shards:
        for offset, piece in shard.pieces:
            if shard.numel != numel or offset < 0 or offset + piece.numel() > numel:
                raise CheckpointError(f"{key}: rank {shard.rank}'s shard lies outside the {numel} elements.")
            flat[offset : offset + piece.numel()] = piece.reshape(-1)
            covered[offset : offset + piece.numel()] = True
    if not bool(covered.all()):
        raise CheckpointError(f"{key}: the rank files cover {int(covered.sum())} of its {numel} elements.")
    return flat

