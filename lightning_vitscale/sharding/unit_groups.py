"""Which groups of consecutive blocks can be FSDP units: FSDP2 lets one unit manage a parameter, so a weight two
units (or a unit and the rest of the model) would both manage keeps its blocks in the outer unit, and a member of
a group that another member holds becomes a unit of its own first."""

from __future__ import annotations

from collections import Counter

from torch import nn


def shared_apart(group: list[nn.Module]) -> list[list[nn.Module]]:
    """``group`` as FSDP2 can make it: a member that is also a submodule of another member (timm CoaT's position
    encodings, shared by the blocks that call them) gets no unit of its own in a list-unit, so a later unit (another
    block sharing it, the outer unit) would shard its parameters again (DTensor's "Cannot concatenate overlapping
    meshes"). Each such member is its own unit first; the blocks that call it find it nested."""
    inside = {id(sub) for member in group for sub in member.modules() if sub is not member}
    shared = [member for member in group if id(member) in inside]
    rest = [member for member in group if id(member) not in inside]
    return [[member] for member in shared] + ([rest] if rest else [])


def nested_first(groups: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """``groups`` in the order to make them units: a group whose member other groups' members hold first (the most
    holders first, else as given: whatever holds a module also holds what it holds, so the innermost come first).
    FSDP2's walk stops at a module already a unit, so the holder then leaves it to its own unit; made after it, the
    holder would manage its parameters too and they would be sharded twice. Units follow the step's calls, so a
    module the blocks call (timm CoaT's shared position encodings, first called inside the first block) can come
    after the block holding it."""
    held = Counter(id(sub) for group in groups for member in group for sub in member.modules() if sub is not member)
    holders = [max(held[id(member)] for member in group) for group in groups]
    return [groups[index] for index in sorted(range(len(groups)), key=lambda index: -holders[index])]


def without_tied_parameters(groups: list[list[nn.Module]], model: nn.Module) -> list[list[nn.Module]]:
    """The groups that own no parameter another group or the rest of the model also uses (weights tied across
    blocks, a module two blocks hold, or a head tied to a block's weight): FSDP2 lets one unit manage a parameter, so
    those blocks join the outer unit, which manages both uses, where DDP trains the tie as one parameter."""
    owner_of: dict[int, set[int]] = {}
    roots: set[int] = set()  # the members of earlier groups: FSDP2 stops at a unit, so a later one finds it nested
    for index, group in enumerate(groups):
        for param in managed_parameters(group, roots):
            owner_of.setdefault(id(param), set()).add(index)
        roots.update(id(member) for member in group)
    for param in managed_parameters([model], roots):
        owner_of.setdefault(id(param), set()).add(-1)
    tied = {index for owners in owner_of.values() if len(owners) > 1 for index in owners}
    return [group for index, group in enumerate(groups) if index not in tied]


def managed_parameters(members: list[nn.Module], units: set[int]) -> list[nn.Parameter]:
    """The parameters ``fully_shard(members)`` would manage: FSDP2's walk, which stops at a module already a unit
    (``units``) and nowhere else, so a module two blocks hold is managed by both (sharded twice)."""
    seen: set[int] = set()
    found: list[nn.Parameter] = []

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        found.extend(module.parameters(recurse=False))
        for child in module.children():
            if id(child) not in seen and id(child) not in units:
                visit(child)

    for member in members:
        if id(member) not in seen:
            visit(member)
    return found

