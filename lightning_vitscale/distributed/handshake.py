"""The handshake before a gather outside a step, on the process group's store: every rank states its call at this
point, and the gather runs only where all ranks stated the same one.

A handshake is keyed by where the ranks are (:mod:`.whereabouts`: batches started, the handshakes made there since),
so ranks at the same point meet under one key. Each rank adds one to the point's arrivals, to its kind of call's and
to its call's count; the last to arrive says whether every rank made the same call, or names another kind made
there (both at once). A rank left waiting asks, after :data:`FIRST_ASK_S`, where the others are; one that provably
never comes (a later step, a call at another point, a strategy collective this rank has not entered, gone) ends the
wait on every rank waiting, naming it. Nothing is left pending: a rank that gives up takes its arrival back, so a
later handshake starts clean.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch.distributed as dist

from lightning_vitscale.distributed import whereabouts

AGREE, DIFFER = "agree", "differ"
FIRST_ASK_S = 1.0  # ranks making the same call meet within milliseconds; after this, the waiting rank asks
GONE_CHECK_S = 0.05  # then, where a rank has left the run (its process ended: after `fit`), it asks at once
_LONGEST_ASK_INTERVAL_S = 10.0


class NotComing(RuntimeError):
    """Some rank never makes this call here (its reason), or not within the timeout; this rank's arrival is taken
    back. ``their_kind``: the call that rank makes at this same point instead, if that is why."""

    def __init__(self, reason: str, their_kind: int | None = None, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.their_kind, self.timed_out = their_kind, timed_out


class _Made:
    """The handshakes this process made at its current point in this run, and the last one completed (its keys),
    which the last rank to arrive at the next one deletes."""

    point = ""
    count = 0
    previous: tuple[str, str, str] | None = None


def new_run() -> None:
    """Forget the handshakes made so far (a new side group, a new store prefix): a call one rank made alone, and
    withdrew, must not shift this run's counts at a point the ranks are still at (no batch in between)."""
    _Made.point, _Made.count, _Made.previous = "", 0, None


def meet(store: dist.Store, rank: int, world: int, kinds: Sequence[int], kind: int, call: str, timeout_s: float) -> str:
    """Wait until every rank states its call (``kind``: what it gathers, one of ``kinds``; ``call``: of what) at this
    point: :data:`AGREE` or :data:`DIFFER`; :class:`NotComing` where a rank makes another kind of call here (at
    once), provably never comes, or not within ``timeout_s``."""
    point = str(whereabouts.here().batches)
    _Made.count = _Made.count + 1 if point == _Made.point else 1
    _Made.point = point
    here = f"hs/{point}.{_Made.count}"
    key = f"{here}.{kind}"
    whereabouts.waiting_in(key)
    try:
        store.add(f"{key}/call/{call}", 1)
        store.add(f"{key}/n", 1)
        if store.add(f"{here}/n", 1) == world:  # the last rank to arrive here: every call is counted
            _conclude(store, here, kinds, kind, call, world)
            _forget(store, _Made.previous)
        outcome = _wait(store, here, key, call, rank, world, timeout_s)
    finally:
        whereabouts.waiting_in("")
    _Made.previous = (here, key, call)
    other = outcome.partition("|")[2]
    if other:
        raise NotComing("another rank makes another call here", int(other))
    return outcome


def _conclude(store: dist.Store, here: str, kinds: Sequence[int], kind: int, call: str, world: int) -> None:
    """Every rank is at ``here``: tell each kind of call made there whether every rank made it, and of the same."""
    if store.add(f"{here}.{kind}/n", 0) == world:  # every rank made this kind of call
        agreed = store.add(f"{here}.{kind}/call/{call}", 0) == world
        store.set(f"{here}.{kind}/done", AGREE if agreed else DIFFER)
        return
    made = [k for k in kinds if k == kind or store.add(f"{here}.{k}/n", 0) > 0]
    for k in made:  # each rank waiting under one kind learns that another was made here
        store.set(f"{here}.{k}/done", f"kinds|{min(o for o in made if o != k)}")


def _outcome_within(store: dist.Store, key: str, seconds: float) -> str | None:
    """The outcome, where told within ``seconds`` (ranks making the same call meet within milliseconds)."""
    start, pause = time.monotonic(), 1e-4
    while time.monotonic() - start < seconds:
        if store.check([f"{key}/done"]):
            return store.get(f"{key}/done").decode()
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return None


def _wait(store: dist.Store, here: str, key: str, call: str, rank: int, world: int, timeout_s: float) -> str:
    start = time.monotonic()
    if (outcome := _outcome_within(store, key, GONE_CHECK_S)) is not None:
        return outcome
    left = store.add(whereabouts.RANKS_LEFT, 0) > 0  # a rank whose process ended never comes: ask at once
    pause, next_ask, asker = 1e-3, time.monotonic() if left else start + FIRST_ASK_S, None
    answers: dict[int, whereabouts.Position | str | None] = {}  # each rank's last, for one seen twice the same
    while True:
        if store.check([f"{key}/done"]):
            return store.get(f"{key}/done").decode()
        now, reason = time.monotonic(), None
        if now >= min(start + FIRST_ASK_S, next_ask) and store.check([f"{key}/verdict"]):
            reason = store.get(f"{key}/verdict").decode()  # the rank asking for all found one not coming
        elif now - start >= timeout_s:
            reason = f"|within the timeout ({timeout_s:g} s)"
        elif now >= next_ask:
            if asker is None:  # one rank asks for all: the first to get here
                asker = store.compare_set(f"{key}/asker", "", str(rank)).decode() == str(rank)
            if asker and (reason := _not_coming(store, rank, world, answers)) is not None:
                store.set(f"{key}/verdict", reason)
            next_ask = now + min(now - start, _LONGEST_ASK_INTERVAL_S)
        overdue = now - start >= timeout_s + _LONGEST_ASK_INTERVAL_S  # the outcome did not come either: gone
        if reason is not None and _withdraw(store, here, key, call, world, overdue):
            kind, _, why = reason.partition("|")
            raise NotComing(why, int(kind) if kind else None, timed_out=now - start >= timeout_s)
        time.sleep(pause)
        pause = min(2 * pause, 0.05 if now - start < FIRST_ASK_S else 0.25)


def _not_coming(
    store: dist.Store, rank: int, world: int, answers: dict[int, whereabouts.Position | str | None]
) -> str | None:
    """``"kind|rank R why"`` for the first rank that provably never makes this call here (``kind``: the call it
    makes at this point instead, else empty); ``None``: none found. ``answers``: each rank's previous answer (kept
    up to date)."""
    mine = whereabouts.here()
    for other, theirs in whereabouts.ask(store, [r for r in range(world) if r != rank]).items():
        why = whereabouts.not_coming(mine, theirs, answers.get(other))
        answers[other] = theirs
        if why is not None:
            handshake = theirs.handshake if isinstance(theirs, whereabouts.Position) else ""
            point, _, kind = handshake.rpartition(".")
            same_point = bool(point) and point == mine.handshake.rpartition(".")[0]
            return f"{kind if same_point else ''}|rank {other} {why}"
    return None


def _withdraw(store: dist.Store, here: str, key: str, call: str, world: int, overdue: bool = False) -> bool:
    """Take this rank's arrival back; ``False`` where every rank had arrived meanwhile (the outcome then comes,
    unless ``overdue``: the last rank's process ended before it could tell)."""
    if store.add(f"{here}/n", -1) == world - 1 and not overdue:
        store.add(f"{here}/n", 1)
        return False
    store.add(f"{key}/n", -1)
    store.add(f"{key}/call/{call}", -1)
    return True


def _forget(store: dist.Store, made: tuple[str, str, str] | None) -> None:
    """Delete a completed handshake's keys: every rank has arrived at the next one, so none reads them again."""
    if made is not None:
        here, key, call = made
        for name in (f"{here}/n", f"{key}/n", f"{key}/done", f"{key}/call/{call}"):
            store.delete_key(name)
