"""Which modules and parameters the outer FSDP unit holds (those of no unit of their own), and every unit back to its
shards: what the outer unit's calls outside a step, the traffic report and the unused-parameter fill walk."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard


def reshard_units(outer: nn.Module) -> None:
    """Every FSDP unit under ``outer`` back to its shards, also those kept gathered for backward, which a forward
    without a backward (evaluation, a call outside a step) would leave gathered."""
    for unit in outer.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
        copies = getattr(unit, "compute_copies", None)
        if copies is not None:
            copies.release()


def outer_unit_parameters(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of the parameters the outer unit shards: Shard-placed DTensors outside block units."""
    return [(module, name) for module in modules_outside_units(model)
            for name, param in module.named_parameters(recurse=False)
            if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)]


def modules_outside_units(model: nn.Module) -> list[nn.Module]:
    """``model`` and its sub-modules, not descending into modules that are FSDP units of their own."""
    found, stack = [], [model]
    while stack:
        module = stack.pop()
        found.append(module)
        stack.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return found


def not_a_unit(module: nn.Module) -> bool:
    """Whether ``module`` is no FSDP unit of its own: walks of the outer unit descend into it."""
    return not isinstance(module, FSDPModule)
