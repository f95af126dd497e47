"""Optimizer state between torch's native format (DDP's files: parameters numbered across groups) and DCP's
(keyed by parameter name, sharded), with DDP's behaviour for optimizers that have not stepped yet."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.formats import as_full
from lightning_vitscale.precision.local_step import init_state_locally


def rekey_by_position(optimizer_state: dict[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module):
    """torch-native optimizer state -> keyed by parameter name, as DCP wants; numbers follow the optimizer's own
    parameter order, as torch assigned them (not ``model.parameters()``'s, which param groups reorder)."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {order[i] if isinstance(i, int) else i: v for i, v in optimizer_state["state"].items()}
    groups = [{**g, "params": [order[i] if isinstance(i, int) else i for i in g["params"]]}
              for g in optimizer_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def keeps_flat_state(optimizer: torch.optim.Optimizer) -> bool:
    """LBFGS (one rank only: ``precision/optimizer_probe.py``): its state is flat vectors of all its parameters and
    history lists of varying length under its first parameter, which torch DCP's optimizer state dict cannot make a
    template of (it steps a fresh optimizer without the closure LBFGS needs). It is saved as DCP writes it and read
    whole, into ``optimizer.load_state_dict``, as DDP's resume does."""
    return isinstance(optimizer, torch.optim.LBFGS)


def require_optimizer_states(present: bool, optimizers: list[torch.optim.Optimizer]) -> None:
    """Resuming a fit from a weights-only checkpoint fails under DDP with this KeyError; so it does here."""
    if optimizers and not present:
        raise KeyError(
            "Trying to restore optimizer state but checkpoint contains only the model."
            " This is probably due to `ModelCheckpoint.save_weights_only` being set to `True`."
        )


@contextmanager
def untouched_if_fresh(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """torch's optimizer state-dict functions step a fresh optimizer with zero gradients (Adam's first real step
    is then bias-corrected as the second); under DDP a save before the first step (``lr_find``) changes nothing.
    An optimizer stepping local tensors where DTensor has no rule for its step makes its state there first."""
    fresh = not optimizer.state
    try:
        if fresh and keeps_flat_state(optimizer):  # what its first step makes, so torch's functions step nothing
            optimizer.state[optimizer.param_groups[0]["params"][0]] = {"func_evals": 0, "n_iter": 0}
        elif fresh:
            init_state_locally(optimizer)
        yield fresh
    finally:
        if fresh:
            optimizer.state.clear()


def set_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], options) -> None:
    """Like ``optimizer.load_state_dict`` under DDP: the saved param groups win; a never-stepped state stays empty;
    a parameter saved without state (no gradient yet: an unused mask token) loads, where DCP's strict load refuses."""
    if state["state"]:
        init_state_locally(optimizer)  # DCP's own would step the DTensors (overwritten by the load)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=replace(options, strict=False))
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


def to_torch_format(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state keyed by parameter name -> torch's native format (params numbered across groups)."""
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    return {
        "state": {number[name]: {k: as_full(v, None) for k, v in s.items()}
                  for name, s in optimizer_state.get("state", {}).items()},
        "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in optimizer_state["param_groups"]],
    }


def saved_param_groups(metadata: Metadata, key: str, current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Request exactly the param-group entries the checkpoint holds: a key added since the save (a scheduler's
    ``initial_lr``, after ``lr_find``'s temporary save) is dropped instead of failing DCP's strict load."""
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
