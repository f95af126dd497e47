"""Saving a sharded LightningModule: what the strategy's ``save_checkpoint`` and ``remove_checkpoint`` run.
``"sharded"``: every rank writes and hashes its own DCP shards, nobody gathers the model. ``"full"``: one file in
DDP's format, gathered one tensor at a time (no device holds more than one full parameter beyond its shards).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint.async_save import AsyncSaves, Gather
from lightning_vitscale.checkpoint.commit import candidates, publish, recover, retire
from lightning_vitscale.checkpoint.formats import META, partial_path, pop_sharded_entries
from lightning_vitscale.checkpoint.full_state_dict import gather_sharded_entries, sharded_state_dicts
from lightning_vitscale.checkpoint.manifest import file_sums, write_manifest
from lightning_vitscale.checkpoint.optimizer_state import to_torch_format, untouched_if_fresh
from lightning_vitscale.checkpoint.settings import CheckpointSettings
from lightning_vitscale.checkpoint.storage import DCP_METADATA, Location
from lightning_vitscale.distributed.ranks import RankContext
from lightning_vitscale.row_layout import OwnLayoutSavePlanner, PackedRows, packed_rows, reorder_packed


def model_state_dict(module: nn.Module, full: bool) -> dict[str, Any]:
    """Keyed like the plain LightningModule; ``full``: gathered tensor by tensor (a collective) to the CPU."""
    with sharded_state_dicts():  # DCP gathers (full) or saves the shards itself
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))
    if not full:
        return state  # DTensor shards: DCP writes packed projections in the model's own order (row_layout.py)
    state = {strip_wrapper_prefixes(k): v for k, v in state.items()}
    reorder_packed(state, packed_rows(module), to_model=True)  # DDP's layout
    return state


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool, is_rank_zero: bool):
    """Sharded and keyed by parameter name (DCP), or ``full``: torch's native format on rank 0, as DDP saves it."""
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
    checkpoint: dict[str, Any], location: Location, settings: CheckpointSettings, write_full: Callable[[], None],
    ranks: RankContext | None = None, storage_options: Any | None = None, saves: AsyncSaves | None = None,
    packed: PackedRows | None = None,
) -> None:
    """``"sharded"``: :func:`save_sharded`; ``"full"``: rank 0 writes one file with Lightning's CheckpointIO
    (``write_full``), as DDP does, every sharded entry (ShardedEMA's) gathered first, as DDP's file holds it."""
    ranks = ranks or RankContext()
    if saves is not None:
        saves.wait()  # at most one in flight: the previous save commits before this one touches any folder
    if settings.full:
        gather_sharded_entries(checkpoint, keep=ranks.is_rank_zero, packed=packed or {})
        if ranks.is_rank_zero:
            if location.is_dir():
                retire(location)  # a sharded folder from an earlier save under the same name
            write_full()
        ranks.barrier()
        return
    if storage_options is not None:
        raise TypeError(
            "VitScaleStrategy(state_dict_type='sharded') writes DCP shards and takes no storage_options;"
            " use state_dict_type='full' to save through the Trainer's CheckpointIO plugin."
        )
    save_sharded(checkpoint, location, ranks, saves, packed)


def save_sharded(
    checkpoint: dict[str, Any], location: Location, ranks: RankContext | None = None, saves: AsyncSaves | None = None,
    packed: PackedRows | None = None,
) -> None:
    """Every rank writes its shards into ``<path>.partial`` and hashes its share of the files; rank 0 writes
    Lightning's metadata and commits (``commit.py``: no crash point loses the newest complete checkpoint). With
    ``saves`` the shards are copied to host memory here and written, hashed and committed in the background.
    ``packed`` projections are written in the model's own row order: the folder loads under any layout."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    tensors.update(pop_sharded_entries(checkpoint))  # e.g. ShardedEMA's ema_state_dict
    ranks = ranks or RankContext()
    if not ranks.is_rank_zero:
        tensors = _without_plain_tensors(tensors)
    staging = partial_path(location)
    if ranks.is_rank_zero:
        recover(location)  # an earlier save's interrupted publish first: the newest complete copy stays
        staging.remove()
        staging.fs.makedirs(staging.path, exist_ok=True)
        with staging.child(META).open("wb") as f:
            torch.save(checkpoint, f)  # Lightning's metadata: small, written now
    ranks.barrier()
    finish = partial(_hash_and_commit, staging, location, ranks.rank, ranks.world_size, checkpoint.get("global_step"))
    planner = OwnLayoutSavePlanner(packed or {})
    if saves is not None:
        saves.start(tensors, staging, location, finish, planner)
        return
    metadata = dcp.save(tensors, storage_writer=staging.writer(), planner=planner)  # collective; .metadata last
    finish(metadata, ranks.all_gather_objects)
    ranks.barrier()


def _without_plain_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` less its plain (not DTensor) tensors: DCP writes one rank's copy of each, the rank that balances
    the writes, and a buffer differs by rank (BatchNorm's statistics after a step's own batch): rank 0's is the
    one DDP saves. Dictionaries only: a list keeps its positions."""
    return {key: _without_plain_tensors(value) if isinstance(value, dict) else value for key, value in state.items()
            if not (isinstance(value, torch.Tensor) and not isinstance(value, DTensor))}


def _hash_and_commit(
    staging: Location, location: Location, rank: int, world_size: int, global_step: Any, metadata: Any, gather: Gather
) -> None:
    """Every rank, once all shards and DCP's ``.metadata`` are in ``staging``: hash every ``world_size``-th file
    (rank 0 also both metadata files), right after it was written, while it is cached; rank 0 commits."""
    shards = sorted({info.relative_path for info in metadata.storage_data.values()})
    mine = shards[rank::world_size] + ([DCP_METADATA, META] if rank == 0 else [])
    files = {name: s for sums in gather(file_sums(staging, mine)) for name, s in sums.items()}
    if rank == 0:
        write_manifest(staging, files, {"global_step": global_step})  # written last, it commits the folder
        publish(staging, location)


def remove_checkpoint(location: Location, ranks: RankContext) -> None:
    """Rank 0 removes a checkpoint between two barriers: the first waits for ranks still using it (the caller's
    broadcast of the path does only on gloo, not NCCL), the second keeps every rank until it is gone."""
    ranks.barrier()
    if ranks.is_rank_zero:
        for candidate in candidates(location):  # with what an interrupted save to it left
            retire(candidate)
    ranks.barrier()
