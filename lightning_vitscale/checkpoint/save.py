"""Saving a sharded LightningModule: what the strategy's ``save_checkpoint`` and ``remove_checkpoint`` run.

Two formats. ``"sharded"`` (default): every rank writes its own DCP shards, nobody gathers the model, the save is
atomic. ``"full"``: one ``torch.save`` file in DDP's format (plain LightningModule keys, torch-native optimizer
state), gathered one tensor at a time so no device ever holds more than one full parameter beyond its shards.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint.async_save import AsyncSaves
from lightning_vitscale.checkpoint.consolidate import consolidate_command
from lightning_vitscale.checkpoint.formats import META, partial_path, pop_sharded_entries
from lightning_vitscale.checkpoint.full_state_dict import gather_sharded_entries, sharded_state_dicts
from lightning_vitscale.checkpoint.optimizer_state import to_torch_format, untouched_if_fresh
from lightning_vitscale.checkpoint.settings import CheckpointSettings
from lightning_vitscale.checkpoint.storage import Location, torch_save, write_sharded_marker


def model_state_dict(module: nn.Module, full: bool) -> dict[str, Any]:
    """Keyed like the plain LightningModule. ``full``: gathered tensor by tensor (each ``full_tensor()`` is a
    collective every rank joins), copied to CPU on rank 0 only; the other ranks return an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with sharded_state_dicts():  # DCP gathers (full) or saves the shards itself
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))
    return {strip_wrapper_prefixes(k): v for k, v in state.items()} if full else state


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool, is_rank_zero: bool):
    """Sharded and keyed by parameter name (DCP), or ``full``: torch's native format on rank 0, as DDP saves it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer
    options = StateDictOptions(full_state_dict=full, cpu_offload=True)
    with untouched_if_fresh(optimizer) as fresh, sharded_state_dicts():
        state = get_optimizer_state_dict(module, optimizer, options=options)
    if fresh:
        state["state"] = {}  # as DDP saves an optimizer that has not stepped yet
    if not full:
        return state
    return to_torch_format(state) if is_rank_zero else {}


def save_checkpoint(
    checkpoint: dict[str, Any],
    location: Location,
    settings: CheckpointSettings,
    is_rank_zero: bool,
    barrier: Callable[[], None],
    write_full: Callable[[], None],
    storage_options: Any | None = None,
    saves: AsyncSaves | None = None,
) -> None:
    """``"sharded"``: every rank writes its own shards, atomically; ``"full"``: rank 0 writes one file with
    Lightning's CheckpointIO (``write_full``), as DDP does, with every sharded entry (e.g. ShardedEMA's) gathered
    into whole tensors first, so the file holds what DDP's would."""
    if saves is not None:
        saves.wait()  # at most one in flight: the previous save commits before this one touches any folder
    if settings.full:
        gather_sharded_entries(checkpoint, keep=is_rank_zero)
        save_full(location, is_rank_zero, write_full, barrier)
        return
    if storage_options is not None:
        raise TypeError(
            "VitScaleStrategy(state_dict_type='sharded') writes DCP shards and takes no storage_options;"
            " use state_dict_type='full' to save through the Trainer's CheckpointIO plugin."
        )
    save_sharded(checkpoint, location, is_rank_zero, barrier, saves)


def sharded_save_hint(location: Location) -> str:
    """Said once per strategy after its first sharded save: how other tools read the folder."""
    return (
        f"Sharded checkpoint folder written: {location}. `MyModule.load_from_checkpoint(path)` and a resume"
        " under strategy='ddp' read it in any process that has imported lightning_vitscale. One torch.save"
        f" file for other tools: `{consolidate_command(location.url)}`, or VitScaleStrategy(state_dict_type="
        "'full')."
    )


def save_sharded(
    checkpoint: dict[str, Any],
    location: Location,
    is_rank_zero: bool,
    barrier: Callable[[], None],
    saves: AsyncSaves | None = None,
) -> None:
    """Every rank writes its own shards into ``<path>.partial``; rank 0 then writes Lightning's metadata and
    swaps the folder into place. A crash at any point leaves ``path`` as it was (the previous checkpoint stays
    loadable) and a ``.partial`` folder that never loads as if complete. With ``saves`` the shards are copied
    into host memory here and written in the background (``async_save.py``); the swap follows every rank's write."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    tensors.update(pop_sharded_entries(checkpoint))  # e.g. ShardedEMA's ema_state_dict
    staging = partial_path(location)
    if is_rank_zero:
        staging.remove()
        staging.fs.makedirs(staging.path, exist_ok=True)
        torch_save(checkpoint, staging.child(META))  # Lightning's metadata: small, written now
    barrier()
    commit = partial(_commit, staging, location)
    if saves is not None:
        saves.start(tensors, staging, location, commit)
        return
    dcp.save(tensors, storage_writer=staging.writer())  # collective; coordinator writes .metadata after all shards
    if is_rank_zero:
        commit()
    barrier()


def _commit(staging: Location, location: Location) -> None:
    """Rank 0, once every rank's shards and DCP's ``.metadata`` are in ``staging``: mark it ours, swap it in."""
    write_sharded_marker(staging)
    _swap_into_place(staging, location)


def _swap_into_place(staging: Location, location: Location) -> None:
    old = location.with_suffix(".old")
    old.remove()
    if location.exists():
        location.move_to(old)
    staging.move_to(location)
    old.remove()


def save_full(location: Location, is_rank_zero: bool, write: Callable[[], None], barrier: Callable[[], None]) -> None:
    """Rank 0 writes the gathered checkpoint with Lightning's CheckpointIO (``write``), exactly as DDP does."""
    if is_rank_zero and location.is_dir():
        location.remove()  # a sharded folder from an earlier save under the same name
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
        location.remove()
    barrier()
