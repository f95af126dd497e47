"""Whether an optimizer steps sharded parameters as it steps whole ones, found by running it once at setup.

Elementwise optimizers (``precision/elementwise.py``) step each shard's local tensor; every other one steps the
DTensor parameters, where its ops must have DTensor rules. Many do (timm's LAMB, LARS, Lion, Adan, torch's Muon:
DDP's losses on 2 ranks), some do not (torch's and timm's Adafactor: an in-place op DTensor cannot place, a state
tensor made plain), and a step that reads ``p.to_local()`` would give other numbers without a word. Without a
probe that surfaces at the first ``optimizer.step()``, after setup, as DTensor's message. So each such optimizer's
class, with its own defaults, steps a small parameter sharded as the model's are and the same parameter whole,
twice (the first step makes the state, the second reads it); a raise or other numbers refuse it at setup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_vitscale.precision.elementwise import holds_whole_parameters, steps_locally

# What the sharded step's change may differ from the whole step's, relative to it: reduction order (a DTensor matmul
# sums its parts in another order; Muon's bf16 Newton-Schulz iterations round them). A step on one shard's values
# alone differs by the order of the change itself.
_TOLERANCE = 0.05


class UnshardableOptimizerError(RuntimeError):
    """An optimizer whose step fails on FSDP2's sharded (DTensor) parameters, or gives other numbers there."""


def refuse_unshardable(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise :class:`UnshardableOptimizerError` for the first optimizer that does not step DTensor parameters as it
    steps plain ones (every rank probes the same, so every rank raises alike)."""
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            if not holds_whole_parameters(optimizer):
                raise UnshardableOptimizerError(_LBFGS_ON_SHARDS)
            continue  # one rank: stepped on its whole local tensors (``local_step.lbfgs_on_whole_locals``)
        if steps_locally(optimizer):
            continue  # local shards (element for element, or whole on one rank)
        placed = [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, DTensor)]
        if not placed:
            continue
        # A sharded one if any: an fp32 norm's parameter is replicated, where a step may work that fails on shards
        sharded = next((p for p in placed if not all(pl.is_replicate() for pl in p.placements)), placed[0])
        problem = _probe(type(optimizer), optimizer.defaults, sharded)
        if problem is not None:
            name = type(optimizer).__name__
            raise UnshardableOptimizerError(
                f"{name} cannot step VitScaleStrategy's sharded parameters: {problem}. Its step runs on DTensor"
                f" shards of each parameter ({sharded.device_mesh.size()} rank(s) here), and DTensor {_WHY}"
                " Optimizers that update each element alone (SGD, Adam, AdamW, RMSprop, Rprop, ...) step each shard,"
                " and DTensor-aware ones (timm's LAMB, LARS, Lion, Adan; torch's Muon) step the DTensors: use one of"
                f" those, or strategy=\"ddp\" for a model trained with {name}."
            )


_LBFGS_ON_SHARDS = (
    "LBFGS cannot step VitScaleStrategy's sharded parameters: its step treats every parameter as one flat vector"
    " (inner products, norms and line search over all of them), and each rank holds only its shard of each"
    " parameter. On one device it trains as under DDP; on several, use strategy=\"ddp\" for a model trained with"
    " LBFGS (a full-batch method for models that fit one device whole), or a first-order optimizer."
)

_WHY = "has no rule for an op of its step (or its step treats a shard as the whole parameter)."


def _probe(kind: type[torch.optim.Optimizer], defaults: dict[str, Any], like: DTensor) -> str | None:
    """``None`` where two steps of a ``kind`` with ``defaults`` on a parameter sharded like ``like`` equal (within
    :data:`_TOLERANCE`) two on the same parameter whole; else what went wrong. Where the probe's own optimizer cannot
    step the whole parameter, the probe says nothing (``None``): the refusal is for what fails on shards only."""
    mesh, placements, device = like.device_mesh, like.placements, like.to_local().device
    generator = torch.Generator().manual_seed(0)
    # Uneven shards, as FSDP2 pads them; both sides at least 32 (Adafactor factors a side of 16 or more, else it
    # steps the parameter element by element, which any layout passes).
    rows = 2 * mesh.size() + 33
    values, grads = (torch.randn(rows, 40, generator=generator).to(device) for _ in range(2))
    try:
        whole = nn.Parameter(values.clone())
        split = nn.Parameter(distribute_tensor(values.clone(), mesh, placements))
        plain, probed = _built(kind, defaults, whole), _built(kind, defaults, split)
        for _ in range(2):
            whole.grad = grads.clone()
            plain.step()
    except Exception:  # noqa: BLE001 - a class not built again from its defaults, a layout not reproduced
        return None
    try:
        for _ in range(2):
            split.grad = distribute_tensor(grads.clone(), mesh, placements)
            probed.step()
        got = cast(DTensor, split).full_tensor()
    except Exception as error:  # noqa: BLE001 - the refusal names it
        said = (str(error).splitlines() or [""])[0][:300].rstrip(".!")
        return f"its step on a DTensor raised {type(error).__name__}: {said}"
    change, difference = (whole - values).norm(), (got - whole).norm()
    if difference > _TOLERANCE * change + 1e-7:
        return (f"its step on a sharded parameter changed it other than on the whole parameter (by"
                f" {float(difference):.3g} against a change of {float(change):.3g})")
    return None


def _built(kind: type[torch.optim.Optimizer], defaults: dict[str, Any], param: nn.Parameter) -> torch.optim.Optimizer:
    """``kind`` over ``param`` with ``defaults``: through its constructor, or where that takes other arguments than
    it keeps (timm's Adafactor keeps ``beta1`` from ``betas``), through ``Optimizer.__init__`` alone."""
    try:
        return kind([param], **defaults)
    except TypeError:
        made = kind.__new__(kind)
        torch.optim.Optimizer.__init__(made, [param], dict(defaults))
        return made
