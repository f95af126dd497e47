"""Errors the ranks raise together, by a decision they took together (a collective), not one rank's accident."""

from __future__ import annotations


class RaisedOnEveryRank(Exception):
    """Mixin for an exception every rank raises at the same point, decided together (e.g. the non-finite guard's
    all-reduce): ``teardown.stop_local_ranks`` then lets each rank end through its own handling, as under DDP,
    since none is blocked in a collective; after a lone rank's exception its peers are stuck and stopped at once."""
