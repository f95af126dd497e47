"""Loading into a sharded LightningModule: what the strategy's ``load_checkpoint`` runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.formats import (
    META,
    checkpoint_shapes,
    load_full,
    model_shapes,
    require_match,
    sharded_entries,
)
from lightning_vitscale.checkpoint.full_state_dict import sharded_state_dicts
from lightning_vitscale.checkpoint.optimizer_state import (
    keeps_flat_state,
    rekey_by_position,
    require_optimizer_states,
    saved_entries,
    saved_param_groups,
    set_optimizer_state,
    to_torch_format,
    untouched_if_fresh,
)
from lightning_vitscale.checkpoint.safe_reading import load_all, load_into, load_member, read_metadata
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.row_layout import packed_rows, reorder_packed


@dataclass
class HandedModelState:
    """The model's state a load hands to ``on_load_checkpoint`` as ``checkpoint["state_dict"]``, as Lightning hands
    DDP's, and applies after the hook (:func:`apply_model_state`): a file's whole tensors, not loaded yet; or a
    folder's values, read into the shards already (DCP loads in place), whose entries the hook may replace."""

    from_file: bool
    handed: dict[str, int] = field(default_factory=dict)  # key -> id of the value handed out


def load_checkpoint(
    location: Location, module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool,
    weights_only: bool | None,
) -> tuple[dict[str, Any], HandedModelState]:
    """Validate on every rank before the first collective, then fill the optimizers' shards, and the module's from a
    folder of any world size and layout (a file's: after the hook); returns Lightning's metadata, its
    ``"state_dict"`` the model's state for ``on_load_checkpoint``."""
    with sharded_state_dicts():  # DTensors report global shapes ungathered; DCP loads into the shards
        found = checkpoint_shapes(location.url, weights_only)
        require_match(model_shapes(module), found, f"Checkpoint {location} does not match the model", strict=strict)
        if location.is_file():
            checkpoint = _load_file(load_full(location, weights_only), module, optimizers)
            return checkpoint, HandedModelState(from_file=True)
        metadata = read_metadata(location, weights_only)
        checkpoint = load_member(location, META, weights_only)
        packed = packed_rows(module)
        request: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        require_optimizer_states(bool(saved_entries(metadata, "optimizer_0", "param_groups")), optimizers)
        for i, optimizer in enumerate(optimizers):
            if keeps_flat_state(optimizer):
                continue  # read whole below
            with untouched_if_fresh(optimizer):
                state: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizer))
            saved = {path[2] for path in saved_entries(metadata, f"optimizer_{i}", "state")}  # as DDP's file: no
            state["state"] = {n: s for n, s in state["state"].items() if n in saved}  # state before a first gradient
            state["param_groups"] = saved_param_groups(metadata, f"optimizer_{i}", state["param_groups"])
            request[f"optimizer_{i}"] = state
        load_into(request, location, weights_only, strict=strict, packed=packed)
        loaded = request.pop("state_dict")
        set_model_state_dict(module, loaded, options=StateDictOptions(strict=strict))
        whole = load_all(location, weights_only) if any(map(keeps_flat_state, optimizers)) else {}  # one rank
        for i, optimizer in enumerate(optimizers):
            if keeps_flat_state(optimizer):
                optimizer.load_state_dict(to_torch_format(whole[f"optimizer_{i}"]))
            else:
                set_optimizer_state(module, optimizer, request[f"optimizer_{i}"], StateDictOptions(cpu_offload=True))
        checkpoint.update(sharded_entries(location, weights_only, packed))  # their owners load them
    checkpoint["state_dict"] = loaded
    return checkpoint, HandedModelState(from_file=False, handed={k: id(v) for k, v in loaded.items()})


def apply_model_state(checkpoint: Mapping[str, Any], handed: HandedModelState, module: nn.Module, strict: bool) -> None:
    """After ``on_load_checkpoint``, ``checkpoint["state_dict"]`` into the model, as Lightning loads DDP's: a file's
    as the hook left it; a folder's entries the hook replaced (its others are in the shards already)."""
    state = checkpoint.get("state_dict")
    if handed.from_file:
        weights = dict(state if state is not None else {})
        reorder_packed(weights, packed_rows(module), to_model=False)
        with sharded_state_dicts():
            set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, strict=strict))
        return
    current = state if state is not None else {}
    removed = sorted(set(handed.handed) - set(current))
    if removed:
        raise CheckpointError(
            f"on_load_checkpoint removed {len(removed)} entries from checkpoint['state_dict'] (e.g. {removed[:3]}),"
            " but a sharded checkpoint is read into the model's shards before the hook: they were loaded already."
            " Load a one-file checkpoint instead, where the hook's edits apply as under DDP (VitScaleStrategy("
            "state_dict_type='full'), or `python -m lightning_vitscale consolidate FOLDER FILE`), or reset those"
            " weights after the load (in `on_load_checkpoint`, by replacing the entries)."
        )
    replaced = {k: v for k, v in current.items() if handed.handed.get(k) != id(v)}
    if replaced:  # outside sharded_state_dicts(): a whole plain tensor is cut into this rank's shard
        module.load_state_dict(replaced, strict=False)


def _load_file(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> dict[str, Any]:
    """DDP's one-file format, the optimizers' states: packed projections' rows from the model's own order into this
    run's. The weights stay in ``checkpoint["state_dict"]`` for the hook (:func:`apply_model_state`)."""
    require_optimizer_states("optimizer_states" in checkpoint, optimizers)
    options = StateDictOptions(full_state_dict=True)
    packed = packed_rows(module)
    for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        if keeps_flat_state(optimizer):
            optimizer.load_state_dict(state)  # DDP's own format: torch's, numbered
            continue
        state = rekey_by_position(state, optimizer, module)
        reorder_packed(state["state"], packed, to_model=False)
        set_optimizer_state(module, optimizer, state, options)
    return checkpoint
