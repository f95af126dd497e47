"""Where each parameter lies inside FSDP1's flat parameters, rebuilt from the plain model (the files do not say).

FSDP1's rules (``FlatParamHandle._init_flat_param_and_metadata``): units wrap bottom-up, each flattening its
subtree's parameters no nested unit claimed, in ``named_modules(remove_duplicate=False)`` order, a shared one once;
with ``use_orig_params=True`` each starts at a multiple of 16 bytes and the whole is padded to a multiple of the
world size. Every candidate layout is tried against the recorded sizes; an ambiguity is an error, not a guess.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lightning_vitscale.checkpoint.errors import CheckpointError

# 0: use_orig_params=False (no alignment); then 16 bytes in fp32, bf16/fp16 and fp64 elements.
ALIGNMENTS = (0, 4, 8, 2)


@dataclass(frozen=True)
class FlatEntry:
    """One parameter inside a unit's flat parameter: every name the plain model's state dict has for it."""

    names: tuple[str, ...]
    shape: torch.Size


@dataclass(frozen=True)
class Unit:
    """An FSDP1 unit: its module's name in the plain model ("" for the root) and its parameters in order."""

    name: str
    entries: tuple[FlatEntry, ...]


def flat_units(model: nn.Module, unit_names: set[str]) -> list[Unit]:
    """The units named ``unit_names``, each with the parameters FSDP1 flattened into it."""
    modules = dict(model.named_modules())
    unknown = sorted(unit_names - set(modules))
    if unknown:
        raise CheckpointError(
            f"the checkpoint holds flat parameters of FSDP1 units {unknown[:5]}, but the model has no such modules"
            f" (its top-level modules: {[name for name, _ in model.named_children()][:8]}). Pass the model that"
            " FSDP1 wrapped, built with the same configuration."
        )
    aliases: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(param, []).append(name)
    claimed: set[nn.Parameter] = set()
    units = []
    for name in _bottom_up(model, "", unit_names):
        units.append(Unit(name, tuple(_unit_entries(modules[name], claimed, aliases))))
    return units


def _bottom_up(module: nn.Module, name: str, unit_names: set[str]) -> Iterator[str]:
    """Unit names in FSDP1's wrapping order: a module's children (recursively) before the module."""
    for child_name, child in module.named_children():
        yield from _bottom_up(child, f"{name}.{child_name}" if name else child_name, unit_names)
    if name in unit_names:
        yield name


def _unit_entries(
    unit: nn.Module, claimed: set[nn.Parameter], aliases: dict[nn.Parameter, list[str]]
) -> Iterator[FlatEntry]:
    own = {param for param in unit.parameters() if param not in claimed}  # parameters hash by identity
    claimed.update(own)
    seen: set[nn.Parameter] = set()
    for _, submodule in unit.named_modules(remove_duplicate=False):
        for param in submodule.parameters(recurse=False):
            if param in own and param not in seen:
                seen.add(param)
                yield FlatEntry(tuple(aliases[param]), param.shape)


def offsets(unit: Unit, aligned_numel: int, world_size: int) -> tuple[list[int], int]:
    """Each parameter's offset in the unit's flat parameter and the size FSDP1 records for it."""
    total, starts = 0, []
    for entry in unit.entries:
        if aligned_numel:
            total += -total % aligned_numel
        starts.append(total)
        total += entry.shape.numel()
    if aligned_numel:
        total += -total % world_size
    return starts, total


def choose_alignment(units: list[Unit], sizes: dict[str, int], world_size: int, aligned_numel: int | None) -> int:
    """The one alignment under which every unit's layout has the size recorded in the files."""
    candidates = ALIGNMENTS if aligned_numel is None else (aligned_numel,)
    fitting = [a for a in candidates if all(offsets(u, a, world_size)[1] == sizes[u.name] for u in units)]
    if not fitting:
        raise CheckpointError(_mismatch(units, sizes, world_size, candidates))
    layouts = {tuple(tuple(offsets(u, a, world_size)[0]) for u in units): a for a in fitting}
    if len(layouts) > 1:
        raise CheckpointError(
            f"the files fit FSDP1 layouts with alignments {fitting} (elements), which place the parameters"
            " differently. Say which one FSDP1 used: aligned_numel=0 for use_orig_params=False, else 16 bytes in"
            " the forward dtype (4: fp32, 8: bf16/fp16 mixed precision)."
        )
    return fitting[0]


def _mismatch(units: list[Unit], sizes: dict[str, int], world_size: int, candidates: tuple[int, ...]) -> str:
    """Which unit differs, by how much: the model is not the one FSDP1 wrapped."""
    for unit in units:
        plain = sum(entry.shape.numel() for entry in unit.entries)
        if all(offsets(unit, a, world_size)[1] != sizes[unit.name] for a in candidates):
            return (
                f"FSDP1 unit {unit.name or '<root>'!r}: the model's parameters there hold {plain} elements"
                f" ({len(unit.entries)} tensors; with use_orig_params padding up to"
                f" {max(offsets(unit, a, world_size)[1] for a in candidates)}), the checkpoint's flat parameter"
                f" {sizes[unit.name]}: {sizes[unit.name] - plain:+d}. Build the model with the configuration it"
                " was trained with (depth, widths), and the same modules wrapped."
            )
    return "the units fit only under different alignments: the files do not come from one FSDP1 configuration."


def split(unit: Unit, flat: torch.Tensor, starts: list[int]) -> dict[str, torch.Tensor]:
    """The unit's parameters cut out of its whole flat parameter, each under every name it has (own storage)."""
    out = {}
    for entry, start in zip(unit.entries, starts, strict=True):
        value = flat[start : start + entry.shape.numel()].view(entry.shape).clone()
        out.update(dict.fromkeys(entry.names, value))
    return out
