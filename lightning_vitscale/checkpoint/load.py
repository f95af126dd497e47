"""Loading into a sharded LightningModule: what the strategy's ``load_checkpoint`` runs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

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


def load_checkpoint(
    location: Location, module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Validate on every rank before the first collective, then fill the module's and optimizers' shards from a
    folder of any world size and layout, or from a file; returns Lightning's metadata."""
    with sharded_state_dicts():  # DTensors report global shapes ungathered; DCP loads into the shards
        found = checkpoint_shapes(location.url, weights_only)
        require_match(model_shapes(module), found, f"Checkpoint {location} does not match the model", strict=strict)
        if location.is_file():
            return _load_file(load_full(location, weights_only), module, optimizers, strict)
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
        set_model_state_dict(module, request.pop("state_dict"), options=StateDictOptions(strict=strict))
        whole = load_all(location, weights_only) if any(map(keeps_flat_state, optimizers)) else {}  # one rank
        for i, optimizer in enumerate(optimizers):
            if keeps_flat_state(optimizer):
                optimizer.load_state_dict(to_torch_format(whole[f"optimizer_{i}"]))
            else:
                set_optimizer_state(module, optimizer, request[f"optimizer_{i}"], StateDictOptions(cpu_offload=True))
        checkpoint.update(sharded_entries(location, weights_only, packed))  # their owners load them
        return checkpoint


def _load_file(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool
) -> dict[str, Any]:
    """DDP's one-file format: packed projections' rows from the model's own order into this run's."""
    require_optimizer_states("optimizer_states" in checkpoint, optimizers)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    packed = packed_rows(module)
    weights = dict(checkpoint.pop("state_dict"))
    reorder_packed(weights, packed, to_model=False)
    set_model_state_dict(module, weights, options=options)
    for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        if keeps_flat_state(optimizer):
            optimizer.load_state_dict(state)  # DDP's own format: torch's, numbered
            continue
        state = rekey_by_position(state, optimizer, module)
        reorder_packed(state["state"], packed, to_model=False)
        set_optimizer_state(module, optimizer, state, options)
    return checkpoint
