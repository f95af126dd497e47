"""SIGTERM without a collective inside the signal handler.

Lightning 2.6's SIGTERM handler broadcasts from rank 0 *inside the handler*: a rank signalled alone pairs it with
the others' next collective and the job hangs until the timeout, under DDP too (found by benchmarks/chaos.py).
:func:`take_over_sigterm` replaces it for the stage with the rest of its work: the signal forwarded to the local
ranks (once), the trainer marked so its loops stop at the next batch boundary (the loop's own per-batch broadcast
carries rank 0's mark), and the handler from before Lightning's run. Lightning's teardown restores the original.
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
