"""SIGTERM without a collective inside the signal handler.

Lightning 2.6's SIGTERM handler broadcasts from rank 0 *inside the handler*. A rank signalled alone (a cluster
preempting one task, a ``kill`` by hand), or at another point of its collectives than rank 0, pairs that broadcast
with whatever collective the other ranks issue next, and the job hangs until the process group's timeout (10
minutes by default), under DDP as well: the chaos run (benchmarks/chaos.py, SIGTERM to rank 1 as a step began)
found it. Once Lightning has registered its handler (the strategy's stage-start hooks), :func:`take_over_sigterm`
puts this one in its place for the stage. It does what Lightning's does but the broadcast: forwards the signal to
the local ranks the launcher started (once), marks the trainer so that its loops stop at the next batch boundary
(rank 0's mark reaches every rank through the loop's own per-batch broadcast; a rank signalled alone stops alone,
and the others fail at their next collective with it), and runs the handler that was there before Lightning's.
Lightning's teardown restores the process's own handler at the end of the stage.
"""

from __future__ import annotations

import logging
import signal
from functools import partial
from types import FrameType
from typing import Any

from lightning_vitscale._compat import mark_sigterm_received, sigterm_handlers_but_lightnings

log = logging.getLogger(__name__)


def take_over_sigterm(module: Any, launcher: Any) -> None:
    """Replace the SIGTERM handler Lightning registered for the stage ``module``'s trainer runs (idempotent)."""
    current = signal.getsignal(signal.SIGTERM)
    if module is None or (isinstance(current, partial) and current.func is _on_sigterm):
        return
    others = sigterm_handlers_but_lightnings(current)
    signal.signal(signal.SIGTERM, partial(_on_sigterm, module.trainer, launcher, others))


def _on_sigterm(trainer: Any, launcher: Any, others: list[Any], signum: int, frame: FrameType | None) -> None:
    log.info(f"[rank: {trainer.global_rank}] Received SIGTERM: {signum}")
    if not trainer.received_sigterm and launcher is not None:
        launcher.kill(signum)  # the local ranks this process started
    mark_sigterm_received(trainer)
    for handler in others:
        handler(signum, frame)
