"""Where each rank is in the run, so that a rank waiting alone in a handshake learns at once that the others are not
coming, instead of waiting out the strategy's timeout (10 minutes): the DDP habit ``if trainer.is_global_zero:
model.state_dict()`` in ``on_train_batch_end`` while the others go on to their next batch.

Each rank counts, in a plain Python int its main thread writes (nothing is sent per step), the batches it started in
any loop. A thread per rank answers, on its own connection to the process group's store, a waiting rank's question
"where are you?". Another rank provably never reaches this handshake where it started a later batch (it waits in
that batch's collectives, which need this rank), waits in another handshake, or has left the run: both would wait
for each other until the timeout. Anything else (a rank behind, busy, silent, or in a collective of the same batch)
is waited for. Counting the strategy's collectives too was tried: at setup rank 0 entered its ``broadcast`` 4 times
where rank 1 entered it twice (the planner's), so the counts at one point differed across ranks.
"""

from __future__ import annotations

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
ANSWER_S = 2.0  # how long a waiting rank waits for the others' answers (threads: milliseconds unless frozen)

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Position:
    """A rank's place in its run: batches started (every loop's), and the handshake it waits in (``""``: none)."""

    batches: int = 0
    handshake: str = ""

    def encode(self) -> str:
        return f"{self.batches},{self.handshake}"

    @classmethod
    def decode(cls, text: str) -> Position:
        batches, handshake = text.split(",", 1)
        return cls(int(batches), handshake)


class _Here:
    """This process's position: written by the main thread, read by its answering thread."""

    position = Position()


def here() -> Position:
    return _Here.position


def note_batch() -> None:
    """A loop started a batch on this rank (called by the strategy's ``*_step`` hooks, on every rank alike)."""
    _Here.position = replace(_Here.position, batches=_Here.position.batches + 1)


def counting_batch(step: _F) -> _F:
    """``step`` (a strategy's ``validation_step`` & co.) that first counts its batch."""

    @wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        note_batch()
        return step(*args, **kwargs)

    return counted  # type: ignore[return-value]


def counting_batches(strategy: Any) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``strategy``'s ``validation_step``, ``test_step`` and ``predict_step``, each counting its batch (a training
    batch is counted by the sharded model's ``before_training_step``)."""
    return counting_batch(strategy.validation_step), counting_batch(strategy.test_step), counting_batch(
        strategy.predict_step)


def waiting_in(handshake: str) -> None:
    """This rank waits in ``handshake`` (``""``: no longer)."""
    _Here.position = replace(_Here.position, handshake=handshake)


def not_coming(mine: Position, theirs: Position | str | None) -> str | None:
    """Why a rank at ``theirs`` can never join this rank's handshake at ``mine`` (``None``: it may)."""
    if theirs == GONE:
        return "has left the run (its process ended, or it set up a new one)"
    if not isinstance(theirs, Position):
        return None  # no answer: busy holding the interpreter, or slow; waited for
    if theirs.batches > mine.batches:
        return "went on to a later step"
    if theirs.handshake and theirs.handshake != mine.handshake:
        return "waits in another such call, made at another point"
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
            return replace(position, batches=position.batches + 1)
        return position

    def stop(self, store: dist.Store) -> None:
        """End the thread, its last answer saying this rank left the run (``store``: another connection than the
        thread's, which its wait holds)."""
        try:
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
