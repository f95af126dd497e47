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
    assert unit not in gather_checks._CHECKS  # nothing kept for a unit with no check left
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

