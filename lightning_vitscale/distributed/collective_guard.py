"""A handshake before a gather outside a step: every rank agrees, or nothing is sent.

Calling the sharded model, or ``state_dict()``, outside a step gathers shards on the model's process group, which
every rank must join; the DDP habit ``if trainer.is_global_zero: ...`` joins one. Measured on 2 gloo ranks: the
gather waits out the timeout and training dies on every rank ("Application timeout caused pair closure"), or,
meeting another rank's FSDP all-gather, gloo aborts ("Received data size doesn't match expected size"); NCCL hangs.

So every rank first states, on the process group's store (:mod:`.handshake`), what it will gather; the gather runs
only when all agree. Where a rank never comes (it went on to a later step, or waits in a strategy collective this
rank has not entered: :mod:`.whereabouts`) the waiting rank learns so within seconds, and after the strategy's
timeout in any case; either way the model's group saw nothing and stays in step. A side gloo group (the same
lifetime) carries the other host-side collectives.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_vitscale._compat import default_store
from lightning_vitscale.distributed import handshake, whereabouts

STATE_DICT = 1  # state_dict(): gathers each sharded tensor of the state dict
MODEL_CALL = 2  # a call of the model or a submodule outside a step: gathers the outer unit, then the blocks
DEEPCOPY = 3  # copy.deepcopy() of the model or a submodule: gathers each parameter whole
SAVE_ON_EXCEPTION = 4  # a checkpoint saved while handling an exception (OnExceptionCheckpoint): every rank writes
SCALAR_READ = 5  # .item() / float() / self.log of a sharded DTensor (scalar_reads.py): every rank's part combined
UNIT_CALL = 6  # a call of a block unit inside a step beyond the calls every rank made so far: may gather it
_WHAT = {STATE_DICT: "state_dict()", MODEL_CALL: "a call of the model (or a submodule) outside a step",
         DEEPCOPY: "copy.deepcopy() of the model (or a submodule)",
         SAVE_ON_EXCEPTION: "a checkpoint save while handling an exception",
         SCALAR_READ: "a read of a sharded tensor's number (`.item()`, `float()`, `self.log`)",
         UNIT_CALL: "this call of the block in this step"}


class NotJoinedError(RuntimeError):
    """Not every rank made the same gathering call; nothing was sent on the model's process group."""


class _Side:
    group: dist.ProcessGroup | None = None
    world: dist.ProcessGroup | None = None  # the default group the side group was made under
    quick: dist.ProcessGroup | None = None  # bounded by QUICK_JOIN_S: handshakes a lone rank must not wait out
    store: dist.Store | None = None  # this run's handshakes (a prefix of the process group's store)
    answering: whereabouts.Answering | None = None
    timeout_s = 0.0  # how long a handshake waits for a rank that may still come
    runs = 0  # side groups opened by this process: the same count on every rank (opened collectively)


# How long a rank handling an exception waits for the others to reach the same checkpoint save: ranks that raised
# together arrive within the same step; a lone one's wait delays the job's end by this much.
QUICK_JOIN_S = 10.0


def open_side_group(timeout: timedelta) -> None:
    """Make the side group (collective, at setup), dropping an earlier one: gloo, which bounds every operation by
    ``timeout``, whatever the model's backend."""
    close_side_group()
    if dist.get_world_size() == 1:
        return  # a lone rank always agrees with itself: no handshake
    group = dist.new_group(backend="gloo", timeout=timeout)
    quick = dist.new_group(backend="gloo", timeout=timedelta(seconds=QUICK_JOIN_S))
    if isinstance(group, dist.ProcessGroup) and isinstance(quick, dist.ProcessGroup):  # every rank is a member
        _Side.group, _Side.world, _Side.quick = group, dist.group.WORLD, quick
        _Side.runs += 1
        handshake.new_run()
        _Side.store = dist.PrefixStore(f"lightning_vitscale/handshakes/{_Side.runs}", default_store())
        if whereabouts.answerable(_Side.store):
            _Side.answering = whereabouts.Answering(_Side.store, dist.get_rank())
        _Side.timeout_s = timeout.total_seconds()


def close_side_group() -> None:
    """Destroy the side groups, if the process group they were made under is still the current one (local)."""
    group = side_group()
    quick = _Side.quick if group is not None else None
    if _Side.answering is not None and _Side.store is not None:
        _Side.answering.stop(_Side.store)  # its last answer: this rank left the run
    _Side.group = _Side.world = _Side.quick = _Side.store = _Side.answering = None
    for made in (group, quick):
        if made is not None:
            dist.destroy_process_group(made)


def side_group() -> dist.ProcessGroup | None:
    """The group the handshakes run on (``None``: not set up, one rank, or made under an earlier process group)."""
    current = _Side.group is not None and dist.is_initialized() and dist.group.WORLD is _Side.world
    return _Side.group if current else None


def fingerprint(names: Iterable[str]) -> int:
    """A 32-bit checksum of ``names`` in order: two ranks gathering different tensors or modules differ."""
    return zlib.crc32("\n".join(names).encode())


def agree(operation: int, count: int, check: int) -> None:
    """Return when every rank states the same gather (``operation`` of ``count`` tensors, ``check`` their names'
    :func:`fingerprint`) at this point, else raise :class:`NotJoinedError` on every rank making one."""
    if side_group() is None or _Side.store is None:
        return
    what = _WHAT.get(operation, f"operation {operation}")
    this = f"{what} of {count} sharded tensor(s)" if operation == STATE_DICT else what
    try:
        outcome = handshake.meet(_Side.store, dist.get_rank(), dist.get_world_size(), tuple(_WHAT), operation,
                                 f"{count}.{check}", _Side.timeout_s)
    except handshake.NotComing as error:
        if error.their_kind is not None:
            first, second = sorted((operation, error.their_kind))
            others = f"{_WHAT.get(first)} on some ranks, {_WHAT.get(second)} on others"
            raise NotJoinedError(
                f"the ranks made different calls at this point ({others}; this rank: {this}), so nothing was gathered"
            ) from error
        raise NotJoinedError(
            f"not every rank made {what}{' ' if error.timed_out else ': '}{error}; the other ranks went on (to their"
            " next step, a collective of the Trainer's, or past `fit`), so nothing was gathered"
        ) from error
    if outcome != handshake.AGREE:
        raise NotJoinedError(
            f"the ranks made {what} at this point, but of different modules or tensors (this rank: {this}), so"
            " nothing was gathered"
        )


def every_rank_within(operation: int) -> bool:
    """Whether every rank states ``operation`` within :data:`QUICK_JOIN_S`, for a rank that must not wait out the
    side group's timeout (the strategy's: minutes): a save while handling an exception only this rank raised, the
    others blocked in a step's collectives. On a group of its own, whose timeout ends the operation itself (a
    timed-out wait would leave it pending, and destroying the groups at exit would wait for it)."""
    group = _Side.quick if side_group() is not None else None
    if group is None:
        return True
    code = torch.tensor([operation, -operation], dtype=torch.int64)
    try:
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError:  # timed out, or a peer's connection closed (it ended)
        return False
    return int(code[0]) == operation == -int(code[1])


def not_joined(what: str, error: BaseException, fix: str) -> str:
    """The message for a gather that failed because the other ranks did not join it: this rank, the cause, the fix."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (f"{what}, a collective that every rank must join; on rank {rank} it failed: {error}. {fix} A call the"
            " other ranks never make fails within seconds where they went on to a later batch, wait in a collective"
            " of the Trainer's (ModelCheckpoint's) or ended, else after VitScaleStrategy(timeout=...).")
