"""A checkpoint saved while handling an exception (Lightning's ``OnExceptionCheckpoint``, a user's ``on_exception``)
that only this rank raised: skipped, so the rank ends instead of waiting in collectives no other rank joins.

Under DDP rank 0 writes the whole model alone, so such a save never waits for the others. A sharded save needs every
rank, and so does gathering a full one; a rank that raised alone (a bad sample, a data error on its own shard) would
wait in the save's first collective while the others wait in their step's, until the process group's timeout
(``VitScaleStrategy(timeout=...)``, 10 minutes by default; measured on 2 gloo ranks: the whole job hung). So the
first checkpoint hook while the trainer handles an exception asks every rank, on a side group, within
``collective_guard.QUICK_JOIN_S``: where all raised together (every rank's same error) the save goes on as usual;
otherwise this rank saves nothing, says so, and its exception goes on ending the job (the last complete checkpoint
stays).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from lightning.pytorch.trainer.states import TrainerStatus

from lightning_vitscale._utils import trainer_of
from lightning_vitscale.distributed import collective_guard


class ExceptionSave:
    """Whether this rank's saves are skipped, decided once per exception at the first checkpoint hook."""

    def __init__(self) -> None:
        self._alone: bool | None = None  # None: not decided (no exception being handled)

    def alone(self, trainer: Any) -> bool:
        """True while this rank handles an exception the others did not reach within ``QUICK_JOIN_S``."""
        if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
            self._alone = None  # a later fit with the same strategy decides afresh
            return False
        if self._alone is None:
            self._alone = not collective_guard.every_rank_within(collective_guard.SAVE_ON_EXCEPTION)
        return self._alone

    def skipped(self, filepath: Any) -> None:
        warnings.warn(
            f"VitScaleStrategy: no checkpoint written to {filepath}: this rank is handling an exception the other"
            f" ranks did not reach within {collective_guard.QUICK_JOIN_S:.0f} s (an error on this rank alone; they are"
            " inside a step), and a sharded save needs every rank's shards. The last complete checkpoint stays; the"
            " exception goes on ending the job. (Under DDP rank 0 writes its whole copy alone.)",
            stacklevel=2,
        )


def unless_alone_in_exception(barrier: Callable[..., None]) -> Callable[..., None]:
    """The strategy's ``barrier``, skipped where this rank skipped an exception's save (``Trainer.save_checkpoint``
    ends with one, which no other rank would join)."""

    @functools.wraps(barrier)
    def wrapped(strategy: Any, name: str | None = None) -> None:
        if not strategy.checkpoints.exception_save.alone(trainer_of(strategy.lightning_module)):
            barrier(strategy, name)

    return wrapped
