"""The one registry of checks a unit's gather makes other than by its own forward (``sharding/gather_checks.py``)."""

from __future__ import annotations

from torch import nn

from lightning_vitscale.sharding import gather_checks

Concern = gather_checks.Concern


def test_checks_run_in_the_concerns_order_whatever_the_order_they_came_in():
    unit, ran = nn.Linear(1, 1), []
    gather_checks.register(unit, Concern.FIRST_GATHER, lambda: ran.append("first gather"))
    gather_checks.register(unit, Concern.LONE_CALL, lambda: ran.append("lone call"))
    gather_checks.before_gather(unit)
    assert ran == ["lone call", "first gather"]
    gather_checks.register(unit, Concern.LONE_CALL, lambda: ran.append("lone call, set up again"))  # replaces
    ran.clear()
    gather_checks.before_gather(unit)
    assert ran == ["lone call, set up again", "first gather"]
    gather_checks.unregister(unit, Concern.LONE_CALL)
    gather_checks.unregister(unit, Concern.LONE_CALL)  # twice: nothing left to do
    ran.clear()
    gather_checks.before_gather(unit)
    assert ran == ["first gather"]
    gather_checks.unregister(unit, Concern.FIRST_GATHER)
    assert gather_checks._ATTR not in unit.__dict__  # nothing kept for a unit with no check left
    gather_checks.before_gather(unit)
    assert ran == ["first gather"]


def test_a_check_that_removes_itself_while_the_checks_run_does_not_skip_the_next():
    unit, ran = nn.Linear(1, 1), []

    def once() -> None:
        ran.append("once")
        gather_checks.unregister(unit, Concern.LONE_CALL)

    gather_checks.register(unit, Concern.LONE_CALL, once)
    gather_checks.register(unit, Concern.FIRST_GATHER, lambda: ran.append("first gather"))
    gather_checks.before_gather(unit)
    gather_checks.before_gather(unit)
    assert ran == ["once", "first gather", "first gather"]
    gather_checks.unregister(unit, Concern.FIRST_GATHER)



def test_a_check_holding_its_unit_does_not_keep_it_alive():
    """Each concern's check holds its unit (``functools.partial(first_gathers.before, unit)``, the in-step guard's
    blocks): the registry must not be a root that keeps them (mutation seen failing: the checks in a module-level
    ``WeakKeyDictionary`` keyed by the unit, as before)."""
    import gc
    import weakref

    unit = nn.Linear(1, 1)
    gather_checks.register(unit, Concern.FIRST_GATHER, lambda unit=unit: unit)
    gone = weakref.ref(unit)
    del unit
    gc.collect()
    assert gone() is None
