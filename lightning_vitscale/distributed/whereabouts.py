"""Where each rank is in the run, so that a rank waiting alone in a handshake learns at once that the others are not
coming, instead of waiting out the strategy's timeout (10 minutes): the DDP habit ``if trainer.is_global_zero:
model.state_dict()`` in ``on_train_batch_end`` while the others go on to their next batch, or in
``on_validation_epoch_end`` while they wait in ``ModelCheckpoint``'s collectives.

Each rank counts, in plain Python ints its main thread writes (nothing is sent per step), the batches it started in
any loop, the backwards it started in that batch, and the strategy's collectives (``barrier``, ``broadcast``,
``reduce``, ...: Lightning's callbacks and ``sync_dist`` logging make them) it entered since. A thread per rank
answers, on its own connection to the process group's store, a waiting rank's question "where are you?". Another
rank provably never reaches this handshake where it passed this point without the call (the same program): it
started a later batch, or a backward of this batch this rank has not (it waits in their collectives, which need this
rank), or has stayed in a strategy collective this rank has not entered (more entered since the same batch; seen
twice, so not one it is just leaving); or where it waits in another handshake, or has left the run. Each would wait
for the other until the timeout. Anything else (a rank behind, busy, silent, or in a step's own collectives) is
waited for. The collective counts restart at each batch: at setup rank 0 entered its ``broadcast`` 4 times where
rank 1 entered it twice (the planner's), so counts kept over the whole run differed across ranks at one point.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_vitscale._compat import starts_a_training_batch

GONE = "gone"  # a rank's answer once it left the run (its side group closed: a new setup, or its process ended)
RANKS_LEFT = "ranks_left"  # the store key counting them
ANSWER_S = 2.0  # how long a waiting rank waits for the others' answers (threads: milliseconds unless frozen)

_F = TypeVar("_F", bound=Callable[..., Any])
_S = TypeVar("_S")


@dataclass(frozen=True)
class Position:
    """A rank's place in its run: batches started (every loop's), the strategy's collectives entered since, the one
    it is in (``""``: none), the backwards started since, and the handshake it waits in (``""``: none)."""

    batches: int = 0
    handshake: str = ""
    collectives: int = 0
    inside: str = ""
    backwards: int = 0

    def encode(self) -> str:
        return f"{self.batches},{self.collectives},{self.inside},{self.backwards},{self.handshake}"

    @classmethod
    def decode(cls, text: str) -> Position:
        batches, collectives, inside, backwards, handshake = text.split(",", 4)
        return cls(int(batches), handshake, int(collectives), inside, int(backwards))


class _Here:
    """This process's position: written by the main thread, read by its answering thread; ``depth``: strategy
    collectives under way (one calling another, ``reduce_boolean_decision``'s ``reduce``, counts once)."""

    position = Position()
    depth = 0


def here() -> Position:
    return _Here.position


def note_batch() -> None:
    """A loop started a batch on this rank (called by the strategy's ``*_step`` hooks, on every rank alike)."""
    _Here.position = replace(_Here.position, batches=_Here.position.batches + 1, collectives=0, backwards=0)


def note_backward() -> None:
    """This rank starts a backward of its current batch (the strategy's, each ``manual_backward`` too)."""
    _Here.position = replace(_Here.position, backwards=_Here.position.backwards + 1)


def counting_batch(step: _F) -> _F:
    """``step`` (a strategy's ``validation_step`` & co.) that first counts its batch."""

    @wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        note_batch()
        return step(*args, **kwargs)

    return counted  # type: ignore[return-value]


COUNTED_STEPS = ("validation_step", "test_step", "predict_step")  # a training batch: ``before_training_step``
COUNTED_COLLECTIVES = ("barrier", "broadcast", "reduce", "all_gather", "reduce_boolean_decision")


def counting_collective(collective: _F) -> _F:
    """``collective`` (a strategy's ``broadcast`` & co.) that counts its entry, and says it is in it until it
    returns; not on a ``group`` of the caller's, which the waiting rank may not be in (not counted on any rank)."""
    name, parameters = collective.__name__, list(inspect.signature(collective).parameters)
    at = parameters.index("group") if "group" in parameters else None

    @wraps(collective)
    def counted(*args: Any, **kwargs: Any) -> Any:
        whole = at is None or kwargs.get("group", args[at] if len(args) > at else None) is None
        outermost = _Here.depth == 0 and whole
        if outermost:
            position = _Here.position
            _Here.position = replace(position, collectives=position.collectives + 1, inside=name)
        _Here.depth += 1
        try:
            return collective(*args, **kwargs)
        finally:
            _Here.depth -= 1
            if outermost:
                _Here.position = replace(_Here.position, inside="")

    return counted  # type: ignore[return-value]


def counting_whereabouts(strategy: type[_S]) -> type[_S]:
    """``strategy`` (a class) whose evaluation steps count their batch and whose collectives count their entries:
    what a waiting rank compares (:func:`not_coming`)."""
    for name in COUNTED_STEPS:
        setattr(strategy, name, counting_batch(getattr(strategy, name)))
    for name in COUNTED_COLLECTIVES:
        setattr(strategy, name, counting_collective(getattr(strategy, name)))
    return strategy


def waiting_in(handshake: str) -> None:
    """This rank waits in ``handshake`` (``""``: no longer)."""
    _Here.position = replace(_Here.position, handshake=handshake)


def not_coming(mine: Position, theirs: Position | str | None, before: Position | str | None = None) -> str | None:
    """Why a rank at ``theirs`` (``before``: its previous answer) can never join this rank's handshake at ``mine``
    (``None``: it may)."""
    if theirs == GONE:
        return "has left the run (its process ended, or it set up a new one)"
    if not isinstance(theirs, Position):
        return None  # no answer: busy holding the interpreter, or slow; waited for
    if theirs.batches > mine.batches:
        return "went on to a later step"
    if theirs.batches == mine.batches and theirs.backwards > mine.backwards:
        return "went on to a backward this rank has not started (whose collectives wait for this rank)"
    if theirs.handshake and theirs.handshake != mine.handshake:
        return "waits in another such call, made at another point"
    if (theirs.inside and theirs == before and theirs.batches == mine.batches
            and theirs.collectives > mine.collectives):
        return (f"waits in the strategy's `{theirs.inside}`, a collective this rank has not reached (Lightning's"
                " callbacks, ModelCheckpoint's at `on_validation_end` among them, and `sync_dist` logging make them)")
    return None


class Answering:
    """The thread that answers where this rank is, on its own connection to the store (the main thread may be
    blocked in a collective, or in the store itself)."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store.clone(), rank
        self.main = threading.get_ident()  # the thread that runs the Trainer's loops (it sets up the strategy)
        self.store.set_timeout(timedelta(days=365))  # a question may come at any time; an error ends the thread
        self.thread = threading.Thread(target=self._serve, name="lightning_vitscale-whereabouts", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        answered = 0
        while True:
            try:
                asked = self.store.queue_pop(f"ask/{self.rank}", block=True)
            except RuntimeError:  # the store is gone: the job ended
                return
            if asked == b"stop":
                self.store.set(f"where/{self.rank}", GONE)
                return
            answered += 1
            self.store.set(f"where/{self.rank}", f"{answered}|{self.position().encode()}")

    def position(self) -> Position:
        """This rank's position; a rank in the broadcast that starts each training batch (Lightning >= 2.6, before
        its ``training_step`` counts the batch) has ended its previous batch: counted as in the next."""
        position = _Here.position
        if starts_a_training_batch(sys._current_frames().get(self.main)):
            return replace(position, batches=position.batches + 1, collectives=0, inside="", backwards=0)
        return position

    def stop(self, store: dist.Store) -> None:
        """End the thread, its last answer saying this rank left the run (``store``: another connection than the
        thread's, which its wait holds)."""
        try:
            store.add(RANKS_LEFT, 1)  # a rank waiting alone then asks at once (``handshake``), not after a second
            store.queue_push(f"ask/{self.rank}", "stop")
        except RuntimeError:  # the store is gone (the job ended): so is the thread's wait
            return
        self.thread.join(timeout=ANSWER_S)


def answerable(store: dist.Store) -> bool:
    """Whether ``store`` has what the answering threads use, a store queue and a second connection (torch 2.11 and
    2.14 have both, checked); without them no rank is asked, and every rank is waited for until the timeout."""
    return all(hasattr(store, name) for name in ("clone", "queue_push", "queue_pop"))


def ask(store: dist.Store, ranks: list[int]) -> dict[int, Position | str | None]:
    """Where each of ``ranks`` is (``None``: no answer within :data:`ANSWER_S`), asked through their threads."""
    if not answerable(store):
        return dict.fromkeys(ranks)
    wanted = {rank: store.add(f"asked/{rank}", 1) for rank in ranks}
    for rank in ranks:
        store.queue_push(f"ask/{rank}", "where")
    found: dict[int, Position | str | None] = dict.fromkeys(ranks)
    deadline = time.monotonic() + ANSWER_S
    pending = set(ranks)
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            if not store.check([f"where/{rank}"]):
                continue
            answer = store.get(f"where/{rank}").decode()
            if answer == GONE:
                found[rank] = GONE
                pending.discard(rank)
                continue
            count, _, position = answer.partition("|")
            if int(count) >= wanted[rank]:
                found[rank] = Position.decode(position)
                pending.discard(rank)
        if pending:
            time.sleep(0.01)
    return found
