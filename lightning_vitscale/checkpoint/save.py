"""Saving a sharded LightningModule: what the strategy's ``save_checkpoint`` and ``remove_checkpoint`` run.

Two formats. ``"sharded"`` (default): every rank writes its own DCP shards and hashes them, nobody gathers the
model, and ``commit.py`` makes the save atomic. ``"full"``: one ``torch.save`` file in DDP's format (plain
LightningModule keys, torch-native optimizer state), gathered one tensor at a time so no device ever holds more
than one full parameter beyond its shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint.async_save import AsyncSaves, Gather
from lightning_vitscale.checkpoint.commit import candidates, commit, recover, retire
from lightning_vitscale.checkpoint.formats import META, partial_path, pop_sharded_entries
from lightning_vitscale.checkpoint.full_state_dict import gather_sharded_entries, sharded_state_dicts
from lightning_vitscale.checkpoint.manifest import FileSum, file_sums
from lightning_vitscale.checkpoint.optimizer_state import to_torch_format, untouched_if_fresh
from lightning_vitscale.checkpoint.settings import CheckpointSettings
from lightning_vitscale.checkpoint.storage import DCP_METADATA, Location, torch_save
from lightning_vitscale.distributed.ranks import RankContext
from lightning_vitscale.row_layout import OwnLayoutSavePlanner, packed_rows, reorder_packed


def model_state_dict(module: nn.Module, full: bool) -> dict[str, Any]:
    """Keyed like the plain LightningModule. ``full``: gathered tensor by tensor (each ``full_tensor()`` is a
    collective every rank joins), copied to CPU on rank 0 only; the other ranks return an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with sharded_state_dicts():  # DCP gathers (full) or saves the shards itself
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))
    if not full:
        return state  # DTensor shards: DCP writes packed projections in the model's own order (row_layout.py)
    state = {strip_wrapper_prefixes(k): v for k, v in state.items()}
    reorder_packed(state, packed_rows(module), to_model=True)  # DDP's layout
    return state


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool, is_rank_zero: bool):
    """Sharded and keyed by parameter name (DCP), or ``full``: torch's native format on rank 0, as DDP saves it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if isinstance(optimizer, LightningOptimizer):  # what a LightningModule's `self.optimizers()` hands out
        optimizer = optimizer.optimizer
    options = StateDictOptions(full_state_dict=full, cpu_offload=True)
    with untouched_if_fresh(optimizer) as fresh, sharded_state_dicts():
        state = get_optimizer_state_dict(module, optimizer, options=options)
    if fresh:
        state["state"] = {}  # as DDP saves an optimizer that has not stepped yet
    if not full:
        return state
    if not is_rank_zero:
        return {}
    reorder_packed(cast(dict[str, Any], state["state"]), packed_rows(module), to_model=True)  # momentum: as DDP
    return to_torch_format(state)


def save_checkpoint(
    checkpoint: dict[str, Any],
    location: Location,
    settings: CheckpointSettings,
    is_rank_zero: bool,
    barrier: Callable[[], None],
    write_full: Callable[[], None],
    storage_options: Any | None = None,
    group: RankContext | None = None,
    saves: AsyncSaves | None = None,
    packed: dict[str, tuple[int, int]] | None = None,
) -> None:
    """``"sharded"``: every rank writes its own shards, atomically; ``"full"``: rank 0 writes one file with
    Lightning's CheckpointIO (``write_full``), as DDP does, with every sharded entry (e.g. ShardedEMA's) gathered
    into whole tensors first, so the file holds what DDP's would (``packed``: ``row_layout.packed_rows`` of the model,
    whose per-rank rows those entries get back in the model's own order)."""
    if saves is not None:
        saves.wait()  # at most one in flight: the previous save commits before this one touches any folder
    if settings.full:
        gather_sharded_entries(checkpoint, keep=is_rank_zero, packed=packed or {})
        save_full(location, is_rank_zero, write_full, barrier)
        return
    if storage_options is not None:
        raise TypeError(
            "VitScaleStrategy(state_dict_type='sharded') writes DCP shards and takes no storage_options;"
            " use state_dict_type='full' to save through the Trainer's CheckpointIO plugin."
        )
    save_sharded(checkpoint, location, is_rank_zero, barrier, group, saves, packed)


def save_sharded(
    checkpoint: dict[str, Any],
    location: Location,
    is_rank_zero: bool,
    barrier: Callable[[], None],
    group: RankContext | None = None,
    saves: AsyncSaves | None = None,
    packed: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Every rank writes its own shards into ``<path>.partial`` and hashes its share of the files; rank 0 writes
    Lightning's metadata and commits (``commit.py``). A crash at any point leaves the newest complete checkpoint
    findable (``ckpt_path="last"``, or ``path`` itself) and a ``.partial`` folder that never loads unless its
    save committed. With ``saves`` the shards are copied into host memory here and written, hashed and committed
    in the background (``async_save.py``), the commit after every rank's write. ``packed`` projections (held in
    per-rank row order) are written in the model's own order (``row_layout.py``): the folder loads under any
    tensor-parallel layout."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    tensors.update(pop_sharded_entries(checkpoint))  # e.g. ShardedEMA's ema_state_dict
    global_step = checkpoint.get("global_step")
    group = group or RankContext()
    staging = partial_path(location)
    if is_rank_zero:
        recover(location)  # an earlier save's interrupted publish first: the newest complete copy stays
        staging.remove()
        staging.fs.makedirs(staging.path, exist_ok=True)
        torch_save(checkpoint, staging.child(META))  # Lightning's metadata: small, written now
    barrier()
    finish = partial(_hash_and_commit, staging, location, group, {"global_step": global_step})
    planner = OwnLayoutSavePlanner(packed or {})
    if saves is not None:
        saves.start(tensors, staging, location, finish, planner)
        return
    metadata = dcp.save(tensors, storage_writer=staging.writer(), planner=planner)  # collective; .metadata last
    finish(metadata, group.all_gather_objects)
    barrier()


def _hash_and_commit(
    staging: Location,
    location: Location,
    group: RankContext,
    saved: dict[str, Any],
    metadata: Any,
    gather: Gather,
) -> None:
    """Every rank, once every rank's shards and DCP's ``.metadata`` are in ``staging``: hash this rank's share of
    the files (``gather``: every rank's sums, on every rank), then rank 0 commits."""
    files = hash_share(staging, metadata, dataclasses.replace(group, all_gather_objects=gather))
    if group.rank == 0:
        commit(staging, location, files, saved)


def hash_share(staging: Location, metadata: Any, group: RankContext) -> dict[str, FileSum]:
    """Every rank hashes every ``world_size``-th shard file (rank 0 also DCP's and Lightning's metadata, which it
    wrote); all ranks' sums, merged. Each file is read once, right after it was written, while it is cached."""
    shards = sorted({info.relative_path for info in metadata.storage_data.values()})
    mine = shards[group.rank :: group.world_size] + ([DCP_METADATA, META] if group.rank == 0 else [])
    merged: dict[str, FileSum] = {}
    for sums in group.all_gather_objects(file_sums(staging, mine)):
        merged.update(sums)
    return merged


def save_full(location: Location, is_rank_zero: bool, write: Callable[[], None], barrier: Callable[[], None]) -> None:
    """Rank 0 writes the gathered checkpoint with Lightning's CheckpointIO (``write``), exactly as DDP does."""
    if is_rank_zero and location.is_dir():
        retire(location)  # a sharded folder from an earlier save under the same name
    if is_rank_zero:
        write()
    barrier()


def remove_checkpoint(location: Location, is_rank_zero: bool, barrier: Callable[[], None]) -> None:
    """Remove a checkpoint file or sharded folder once every rank is done with it (rank 0 deletes).

    The first barrier waits for ranks still reading or writing the folder; the caller's broadcast of the path
    does that only on gloo (whose broadcast returns on the root once every rank joined it), not on NCCL, which
    does not wait on the host. The second one keeps any rank from going on while the folder still exists.
    """
    barrier()
    if is_rank_zero:
        for candidate in candidates(location):  # with what an interrupted save to it left
            retire(candidate)
    barrier()
