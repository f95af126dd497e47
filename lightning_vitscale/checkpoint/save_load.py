"""Saving and loading a sharded LightningModule: the mechanism behind the strategy's checkpoint hooks.

Two formats. ``"sharded"`` (default): every rank writes its own DCP shards, nobody gathers the model, the save is
atomic. ``"full"``: one ``torch.save`` file in DDP's format (plain LightningModule keys, torch-native optimizer
state), gathered one tensor at a time so no device ever holds more than one full parameter beyond its shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from lightning_vitscale.checkpoint import (
    META,
    clean_key,
    load_full_into,
    load_pickle,
    model_shapes,
    partial_path,
    pop_sharded_entries,
    refused_values_named,
    require_optimizer_states,
    set_optimizer_state,
    sharded_entries,
    to_torch_format,
    untouched_if_fresh,
    validate_against,
)
from lightning_vitscale.checkpoint_storage import Location, SafeLoadPlanner, torch_save, write_sharded_marker
from lightning_vitscale.full_state_dict import sharded_state_dicts


def model_state_dict(module: nn.Module, full: bool) -> dict[str, Any]:
    """Keyed like the plain LightningModule. ``full``: gathered tensor by tensor (each ``full_tensor()`` is a
    collective every rank joins), copied to CPU on rank 0 only; the other ranks return an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with sharded_state_dicts():  # DCP gathers (full) or saves the shards itself
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))
    return {clean_key(k): v for k, v in state.items()} if full else state


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


def save_sharded(
    checkpoint: dict[str, Any], location: Location, is_rank_zero: bool, barrier: Callable[[], None]
) -> None:
    """Every rank writes its own shards into ``<path>.partial``; rank 0 then writes Lightning's metadata and
    swaps the folder into place. A crash at any point leaves ``path`` as it was (the previous checkpoint stays
    loadable) and a ``.partial`` folder that never loads as if complete."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    tensors.update(pop_sharded_entries(checkpoint))  # e.g. ShardedEMA's ema_state_dict
    staging = partial_path(location)
    if is_rank_zero:
        staging.remove()
    barrier()
    dcp.save(tensors, storage_writer=staging.writer())  # collective; coordinator writes .metadata after all shards
    if is_rank_zero:
        torch_save(checkpoint, staging.child(META))
        write_sharded_marker(staging)
        _swap_into_place(staging, location)
    barrier()


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


def load(
    location: Location,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Validate on every rank before the first collective, then load a sharded folder or a single file."""
    with sharded_state_dicts():  # DTensors report global shapes ungathered; DCP loads into the shards
        validate_against(location.url, model_shapes(module), strict=strict, weights_only=weights_only)
        if location.is_file():
            return load_full_into(location.url, module, optimizers, strict=strict, weights_only=weights_only)
        return load_sharded(location, module, optimizers, strict, weights_only)


def load_sharded(
    location: Location,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Fill the module's and optimizers' shards from any world size's checkpoint; returns Lightning's metadata."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    reader = location.reader(weights_only)
    metadata = reader.read_metadata()
    request: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    require_optimizer_states(bool(saved_entries(metadata, "optimizer_0", "param_groups")), optimizers)
    for i, optimizer in enumerate(optimizers):
        with untouched_if_fresh(optimizer):
            state: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizer))
        if not saved_entries(metadata, f"optimizer_{i}", "state"):
            state["state"] = {}  # saved before its first step
        state["param_groups"] = saved_param_groups(metadata, f"optimizer_{i}", state["param_groups"])
        request[f"optimizer_{i}"] = state
    planner = SafeLoadPlanner(weights_only, allow_partial_load=not strict)
    with refused_values_named(location):
        dcp.load(request, storage_reader=reader, planner=planner)
    set_model_state_dict(module, request.pop("state_dict"), options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state(module, optimizer, request[f"optimizer_{i}"], StateDictOptions(cpu_offload=True))
    checkpoint = load_pickle(location.child(META), weights_only)
    checkpoint.update(sharded_entries(location, weights_only))  # their owners load them into their own DTensors
    return checkpoint


def saved_param_groups(metadata: Metadata, key: str, current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Request exactly the param-group entries the checkpoint holds, as ``Optimizer.load_state_dict`` takes the
    saved groups under DDP. A key added since the save (an LR scheduler's ``initial_lr``, attached by
    ``lr_find`` after its temporary save) is dropped instead of failing DCP's strict load."""
    saved: dict[int, set[str]] = {}
    for path in saved_entries(metadata, key, "param_groups"):
        if len(path) == 4:
            saved.setdefault(int(path[2]), set()).add(str(path[3]))
    if not saved:
        return current
    return [{name: group.get(name) for name in saved.get(j, group.keys())} for j, group in enumerate(current)]


def saved_entries(metadata: Metadata, key: str, part: str) -> list[tuple]:
    """Paths such as ``("optimizer_0", "param_groups", 0, "lr")`` the checkpoint holds under ``key.part``."""
    return [path for path in metadata.planner_data.values() if tuple(path[:2]) == (key, part)]


def remove(location: Location, is_rank_zero: bool, barrier: Callable[[], None]) -> None:
    """Remove a checkpoint file or sharded folder once every rank is done with it (rank 0 deletes).

    The first barrier waits for ranks still reading or writing the folder; the caller's broadcast of the path
    does that only on gloo (whose broadcast returns on the root once every rank joined it), not on NCCL, which
    does not wait on the host. The second one keeps any rank from going on while the folder still exists.
    """
    barrier()
    if is_rank_zero:
        location.remove()
    barrier()
