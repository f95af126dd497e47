"""Errors the ranks raise together, by a decision they took together (a collective), not one rank's accident."""

from __future__ import annotations


class RaisedOnEveryRank(Exception):
    """Mixin for an exception every rank raises at the same point because the ranks decided it together (e.g.
    the non-finite guard's all-reduce). Every rank then ends through its own exception handling, as under DDP:
    stopping the local ranks (``teardown.stop_local_ranks``) waits for them instead of killing them, since none
    is left blocked in a collective. A lone rank's exception is not one of these: its peers are stuck, and are
    stopped at once."""
