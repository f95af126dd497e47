"""The out-of-step handshake on a real TCPStore, one process standing for rank 0 of 2: rank 1's arrivals are written
to the store as its process would write them, and its whereabouts answered by a thread standing for its own."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_vitscale._compat import starts_a_training_batch
from lightning_vitscale.distributed import handshake, whereabouts
from lightning_vitscale.distributed.whereabouts import GONE, Position

STATE_DICT, MODEL_CALL = 1, 2
KINDS = (1, 2, 3, 4, 5)


@pytest.fixture
def store(monkeypatch) -> Iterator[dist.Store]:
    """A fresh store, this process at its 3rd batch with no handshake made yet."""
    monkeypatch.setattr(whereabouts._Here, "position", Position(batches=3))
    monkeypatch.setattr(handshake._Made, "point", "")
    monkeypatch.setattr(handshake._Made, "count", 0)
    monkeypatch.setattr(handshake._Made, "previous", None)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.PrefixStore("test", server)


def rank_one_arrives(store: dist.Store, kind: int, call: str, batches: int = 3, count: int = 1) -> None:
    """What rank 1's ``meet`` writes on arriving first at its ``count``-th handshake at the same point."""
    key = f"hs/{batches}.{count}.{kind}"
    store.add(f"{key}/call/{call}", 1)
    store.add(f"{key}/n", 1)
    store.add(f"hs/{batches}.{count}/n", 1)


def rank_one_answers(store: dist.Store, position: Position | str, times: int = 1) -> threading.Thread:
    """Rank 1's answering thread, at ``position`` (``GONE``: it left the run, counted as ``Answering.stop`` does),
    for ``times`` questions."""
    answering = store.clone()
    if position == GONE:
        store.add(whereabouts.RANKS_LEFT, 1)

    def serve() -> None:
        for answered in range(1, times + 1):
            answering.queue_pop("ask/1", block=True)
            value = position if position == GONE else f"{answered}|{position.encode()}"  # type: ignore[union-attr]
            answering.set("where/1", value)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_ranks_stating_the_same_call_agree_at_once_and_different_tensors_differ(store):
    rank_one_arrives(store, STATE_DICT, "4.77")
    assert handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=60) == handshake.AGREE
    rank_one_arrives(store, STATE_DICT, "4.99", count=2)  # its second call at this point, of other tensors
    assert handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=60) == handshake.DIFFER
    # The first handshake's keys, deleted by the last rank to arrive at the next
    assert not store.check(["hs/3.1.1/n"]) and not store.check(["hs/3.1/n"])


@pytest.mark.parametrize(
    "where, reason, within, asked",
    [
        (Position(batches=4), "rank 1 went on to a later step", 2.0, 1),  # asked after FIRST_ASK_S
        # A rank that left is counted: asked at once, after GONE_CHECK_S (mutation seen failing: the count not read,
        # the wait then 1 s)
        (GONE, "rank 1 has left the run", 0.5, 1),
        # The same answer twice (1 s, then 2 s into the wait): in the strategy's collective, staying there
        (Position(batches=3, collectives=1, inside="broadcast"), "rank 1 waits in the strategy's `broadcast`", 4.0, 2),
    ],
)
def test_a_rank_that_never_comes_ends_the_wait_within_seconds_and_the_arrival_is_taken_back(
    store, where, reason, within, asked
):
    """Mutation seen failing: ``whereabouts.not_coming`` returning ``None`` (the wait then runs to its timeout)."""
    thread = rank_one_answers(store, where, times=asked)
    start = time.monotonic()
    with pytest.raises(handshake.NotComing, match=reason) as raised:
        handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=30)
    assert not raised.value.timed_out and raised.value.their_kind is None
    assert time.monotonic() - start < within
    thread.join(timeout=5)
    taken_back = [int(store.get(name)) for name in ("hs/3.1/n", "hs/3.1.1/n", "hs/3.1.1/call/4.77")]
    assert taken_back == [0, 0, 0]


def test_a_rank_at_the_same_point_making_another_call_is_named_at_once(store):
    """The last rank to arrive at the point sees two kinds of call made there and tells both (no waiting, no asking:
    mutation seen failing: ``_conclude`` telling only when one kind was made, the wait then ran to its timeout)."""
    rank_one_arrives(store, MODEL_CALL, "0.5")
    start = time.monotonic()
    with pytest.raises(handshake.NotComing) as raised:
        handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=30)
    assert raised.value.their_kind == MODEL_CALL and time.monotonic() - start < 0.5
    assert store.get("hs/3.1.2/done") == b"kinds|1"  # rank 1's answer: rank 0 made a state_dict() here


def test_a_rank_that_may_still_come_is_waited_for_until_the_timeout(store):
    """Rank 1 at the same batch, in no handshake (behind, or busy in this batch's collectives): waited for."""
    rank_one_answers(store, Position(batches=3))
    with pytest.raises(handshake.NotComing, match=r"within the timeout \(1.5 s\)") as raised:
        handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=1.5)
    assert raised.value.timed_out


def test_a_call_after_a_withdrawn_one_has_a_key_of_its_own_and_a_later_point_starts_afresh(store):
    """Rank 0 gave up its first call at this point (taken back); its next call here is the point's second, so it
    meets a rank making a second call here, not the first's stale count (mutation seen failing: the count not
    advanced by a withdrawn call, the second call then waiting in the first's key until its timeout); at the next
    batch the count starts again at one."""
    rank_one_answers(store, Position(batches=4))
    with pytest.raises(handshake.NotComing):
        handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=30)
    rank_one_arrives(store, STATE_DICT, "4.77", count=2)
    assert handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=5) == handshake.AGREE
    whereabouts.note_batch()
    rank_one_arrives(store, STATE_DICT, "4.77", batches=4)
    assert handshake.meet(store, 0, 2, KINDS, STATE_DICT, "4.77", timeout_s=5) == handshake.AGREE


HERE = Position(3, "hs/3.1.1", collectives=1)  # after one strategy collective in batch 3
IN_REDUCE = Position(3, collectives=2, inside="reduce")  # in a second one


@pytest.mark.parametrize(
    "mine, theirs, before, why",
    [
        (HERE, Position(4), None, "went on to a later step"),
        (HERE, Position(3), None, None),  # the same batch: it may still come
        (HERE, Position(2), None, None),  # behind
        (HERE, Position(3, "hs/3.1.1"), None, None),  # here already
        (HERE, Position(3, "hs/3.2.1"), None, "waits in another such call"),
        (HERE, None, None, None),  # no answer
        (HERE, GONE, None, "has left the run"),
        # In a strategy collective this rank has not entered, seen twice the same: it waits there for this rank.
        # Mutation seen failing: the rule without ``theirs == before`` (the "seen once" case then named it).
        (HERE, IN_REDUCE, IN_REDUCE, "waits in the strategy's `reduce`, a collective this rank has not reached"),
        (HERE, IN_REDUCE, None, None),  # seen once: it may be leaving one that just completed
        (HERE, IN_REDUCE, Position(3, collectives=2), None),  # just entered (or left and entered another)
        (HERE, Position(3, collectives=1, inside="reduce"), Position(3, collectives=1, inside="reduce"), None),  # the
        # one this rank has been through: it is leaving it
        (HERE, Position(3, collectives=2), Position(3, collectives=2), None),  # between collectives: busy
        (HERE, Position(2, collectives=5, inside="barrier"), Position(2, collectives=5, inside="barrier"), None),  # an
        # earlier batch's: behind, its count not comparable
        # A backward of this batch this rank has not started: past this point (mutation seen failing: the rule gone)
        (HERE, Position(3, backwards=1), None, "went on to a backward this rank has not started"),
        (Position(3, "hs/3.1.1", backwards=1), Position(3, backwards=1), None, None),  # the same backward: may come
        (Position(3, "hs/3.1.1", backwards=2), Position(3, backwards=1), None, None),  # behind
        (HERE, Position(2, backwards=3), None, None),  # an earlier batch's backwards: behind
    ],
)
def test_not_coming(mine, theirs, before, why):
    found = whereabouts.not_coming(mine, theirs, before)
    assert (found is None) if why is None else (found is not None and found.startswith(why)), found


def test_a_position_survives_its_encoding():
    position = Position(7, "hs/7.2.1", collectives=3, inside="reduce_boolean_decision", backwards=2)
    assert Position.decode(position.encode()) == position


def test_the_strategys_collectives_count_their_entry_and_say_they_are_in_it(monkeypatch):
    """``reduce_boolean_decision`` (which calls ``reduce``) counts once, and says so while its reduce runs; one on a
    group of the caller's counts on no rank (a waiting rank need not be in it); the count restarts at each batch
    (mutations seen failing: ``counting_whereabouts`` wrapping no collective; the group not looked at)."""
    import lightning.pytorch.strategies.model_parallel as model_parallel
    import lightning.pytorch.strategies.parallel as parallel

    from lightning_vitscale import VitScaleStrategy

    monkeypatch.setattr(whereabouts._Here, "position", Position(batches=2))
    seen: list[Position] = []
    def record(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:  # no process group needed
        seen.append(whereabouts.here())
        return tensor

    monkeypatch.setattr(model_parallel, "_sync_ddp_if_available", record)
    monkeypatch.setattr(parallel, "_all_gather_ddp_if_available", record)
    strategy = VitScaleStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy.reduce_boolean_decision(True, all=False) is True
    assert seen == [Position(2, collectives=1, inside="reduce_boolean_decision")]
    strategy.reduce(torch.ones(()), "a group")
    strategy.all_gather(torch.ones(()), group="a group")
    assert seen[-1] == whereabouts.here() == Position(2, collectives=1)
    strategy.barrier()
    assert strategy.broadcast("x") == "x"
    assert whereabouts.here() == Position(2, collectives=3)  # left each, counted each
    whereabouts.note_backward()
    assert whereabouts.here() == Position(2, collectives=3, backwards=1)
    whereabouts.note_batch()
    assert whereabouts.here() == Position(3)  # a new batch: nothing entered or started in it yet


def test_a_rank_in_lightnings_broadcast_at_a_training_batchs_start_has_ended_its_batch(monkeypatch):
    """Lightning >= 2.6 broadcasts a SIGTERM flag before fetching each training batch, before ``training_step``
    counts it: a rank blocked there is past the previous batch (the usual place of a rank that went on)."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    if not hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        pytest.skip("Lightning < 2.6 has no broadcast at a batch's start")
    seen: list[bool] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: seen.append(
        starts_a_training_batch(sys._getframe())))
    loop = SimpleNamespace(trainer=SimpleNamespace(received_sigterm=False, strategy=SimpleNamespace(root_device="cpu")))
    _TrainingEpochLoop._broadcast_sigterm_tensor(loop)  # type: ignore[arg-type]
    assert seen == [True] and not starts_a_training_batch(sys._getframe())


def test_the_strategys_evaluation_steps_each_count_their_batch(monkeypatch):
    """Validation, test and predict batches count as training ones do: a rank that went on to the next validation
    batch is past this one (mutation seen failing: ``counting_whereabouts`` wrapping no step)."""
    from lightning_vitscale import VitScaleStrategy

    monkeypatch.setattr(whereabouts._Here, "position", Position(batches=0))
    strategy = VitScaleStrategy()
    monkeypatch.setattr(strategy, "_lightning_module", SimpleNamespace(
        validation_step=lambda *a: "v", test_step=lambda *a: "t", predict_step=lambda *a: "p"))
    outputs = [strategy.validation_step(0), strategy.test_step(0), strategy.predict_step(0)]
    assert outputs == ["v", "t", "p"] and whereabouts.here().batches == 3


def test_without_a_store_queue_every_rank_is_waited_for():
    """A store without queues or a second connection: no rank is asked, so none is found not coming (the wait runs
    to its timeout, as before the answering threads)."""
    assert whereabouts.ask(SimpleNamespace(), [1, 2]) == {1: None, 2: None}  # type: ignore[arg-type]
    assert whereabouts.answerable(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
