"""The handshake before a gather outside a step, on the process group's store: every rank states its call at this
point, and the gather runs only where all ranks stated the same one.

A handshake is keyed by where the ranks are (:mod:`.whereabouts`: batches started, the handshakes made since) and
by the kind of call, so ranks at the same point meet under one key. Each rank adds
one to the key's arrivals and to its call's count; the last to arrive says whether all counts agree. A rank left
waiting asks, after :data:`FIRST_ASK_S`, where the others are; one that provably never comes (a later batch,
another call) ends the wait at once on every rank waiting, naming it. Nothing is left
pending: a rank that gives up takes its arrival back, so a later handshake starts clean.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from lightning_vitscale.distributed import whereabouts

AGREE, DIFFER = "agree", "differ"
FIRST_ASK_S = 1.0  # ranks making the same call meet within milliseconds; after this, the waiting rank asks
_LONGEST_ASK_INTERVAL_S = 10.0


class NotComing(RuntimeError):
    """Some rank never makes this call here (its reason), or not within the timeout; this rank's arrival is taken
    back. ``their_kind``: the call that rank makes at this same point instead, if that is why."""

    def __init__(self, reason: str, their_kind: int | None = None, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.their_kind, self.timed_out = their_kind, timed_out


class _Made:
    """The handshakes this process made at its current point, and the last one completed (key, call), whose keys
    the last rank to arrive at the next one deletes."""

    point = ""
    count = 0
    previous: tuple[str, str] | None = None


def meet(store: dist.Store, rank: int, world: int, kind: int, call: str, timeout_s: float) -> str:
    """Wait until every rank states its call (``kind``: what it gathers; ``call``: of what) at this point:
    :data:`AGREE` or :data:`DIFFER`; :class:`NotComing` where a rank provably never comes, or after ``timeout_s``."""
    point = str(whereabouts.here().batches)
    _Made.count = _Made.count + 1 if point == _Made.point else 1
    _Made.point = point
    key = f"hs/{point}.{_Made.count}.{kind}"
    whereabouts.waiting_in(key)
    try:
        store.add(f"{key}/call/{call}", 1)
        if store.add(f"{key}/n", 1) == world:  # the last to arrive: every call is counted
            agreed = store.add(f"{key}/call/{call}", 0) == world
            store.set(f"{key}/done", AGREE if agreed else DIFFER)
            _forget(store, _Made.previous)
        outcome = _wait(store, key, call, rank, world, timeout_s)
    finally:
        whereabouts.waiting_in("")
    _Made.previous = (key, call)
    return outcome


def _wait(store: dist.Store, key: str, call: str, rank: int, world: int, timeout_s: float) -> str:
    start = time.monotonic()
    pause, next_ask, asker = 1e-4, start + FIRST_ASK_S, None
    while True:
        if store.check([f"{key}/done"]):
            return store.get(f"{key}/done").decode()
        now, reason = time.monotonic(), None
        if now >= start + FIRST_ASK_S and store.check([f"{key}/verdict"]):
            reason = store.get(f"{key}/verdict").decode()  # the rank asking for all found one not coming
        elif now - start >= timeout_s:
            reason = f"|within the timeout ({timeout_s:g} s)"
        elif now >= next_ask:
            if asker is None:  # one rank asks for all: the first to get here
                asker = store.compare_set(f"{key}/asker", "", str(rank)).decode() == str(rank)
            if asker and (reason := _not_coming(store, rank, world)) is not None:
                store.set(f"{key}/verdict", reason)
            next_ask = now + min(now - start, _LONGEST_ASK_INTERVAL_S)
        if reason is not None and _withdraw(store, key, call, world):
            kind, _, why = reason.partition("|")
            raise NotComing(why, int(kind) if kind else None, timed_out=now - start >= timeout_s)
        time.sleep(pause)
        pause = min(2 * pause, 0.05 if now - start < FIRST_ASK_S else 0.25)


def _not_coming(store: dist.Store, rank: int, world: int) -> str | None:
    """``"kind|rank R why"`` for the first rank that provably never makes this call here (``kind``: the call it
    makes at this point instead, else empty); ``None``: none found."""
    mine = whereabouts.here()
    for other, theirs in whereabouts.ask(store, [r for r in range(world) if r != rank]).items():
        why = whereabouts.not_coming(mine, theirs)
        if why is not None:
            handshake = theirs.handshake if isinstance(theirs, whereabouts.Position) else ""
            point, _, kind = handshake.rpartition(".")
            same_point = bool(point) and point == mine.handshake.rpartition(".")[0]
            return f"{kind if same_point else ''}|rank {other} {why}"
    return None


def _withdraw(store: dist.Store, key: str, call: str, world: int) -> bool:
    """Take this rank's arrival back; ``False`` where every rank had arrived meanwhile (the outcome then comes)."""
    if store.add(f"{key}/n", -1) == world - 1:
        store.add(f"{key}/n", 1)
        return False
    store.add(f"{key}/call/{call}", -1)
    return True


def _forget(store: dist.Store, made: tuple[str, str] | None) -> None:
    """Delete a completed handshake's keys: every rank has arrived at the next one, so none reads them again."""
    if made is not None:
        key, call = made
        for name in ("n", "done", f"call/{call}", "asker", "verdict"):
            store.delete_key(f"{key}/{name}")
