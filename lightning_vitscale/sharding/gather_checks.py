"""What must hold before a unit is gathered other than by its own forward: one registry, every concern's checks.

A unit's own forward runs each concern's forward pre-hook before FSDP2's gather. Two other paths gather a unit
without that forward having started: a block unit gathered ahead of its call as its container's forward starts
(``fsdp.prefetch_on_entry``), and the outer unit gathered for a call outside a step (``outer_unit._gather``). Each
asks ``before_gather(unit)``, which runs the checks registered for that unit here, in the order of ``Concern``:

1. ``LONE_CALL`` (``in_step_calls.py``): a call in a step that not every rank makes is refused before it gathers,
   since the gather is a collective the other ranks would pair with something else.
2. ``FIRST_GATHER`` (``first_gathers.py``): the unit's first gather is made outside inference mode.

The refusal comes first: a gather made for a lone call would itself be unpaired. A unit with nothing registered
(after its checks removed themselves, as the first gathers' do after the first training step) costs one dictionary
lookup per gather. The checks live in the unit's own ``__dict__``: each holds its unit (and the blocks of its
concern), which a module-level dictionary keyed weakly by the unit would then have kept alive for the process's
life.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from torch import nn


class Concern(enum.IntEnum):
    """The checks a gather runs, in this order."""

    LONE_CALL = 0
    FIRST_GATHER = 1


_ATTR = "_vitscale_gather_checks"  # in the unit's own __dict__ (plain_copy drops it from a copy)


def register(unit: nn.Module, concern: Concern, check: Callable[[], object]) -> None:
    """``check`` runs before ``unit`` is gathered other than by its own forward; it raises to refuse the gather.
    One check per concern and unit: a later one replaces it (a later setup of the same model)."""
    checks = unit.__dict__.setdefault(_ATTR, {})
    checks[concern] = check
    if list(checks) != sorted(checks):
        unit.__dict__[_ATTR] = dict(sorted(checks.items()))


def unregister(unit: nn.Module, concern: Concern) -> None:
    checks = unit.__dict__.get(_ATTR)
    if checks is not None:
        checks.pop(concern, None)
        if not checks:
            del unit.__dict__[_ATTR]


def before_gather(unit: nn.Module) -> None:
    """Each check registered for ``unit``, in the order of ``Concern``; nothing where none is."""
    checks = unit.__dict__.get(_ATTR)
    if checks:
        for check in list(checks.values()):
            check()
