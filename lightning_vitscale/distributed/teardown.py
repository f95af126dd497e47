"""How a run's processes end: the process group destroyed while Python is still alive (gloo's exit crash), and
the other local ranks stopped when one raises, without cutting short the launching rank's own exception handling;
when every rank raised together (:class:`RaisedOnEveryRank`), each rank's own handling runs to its end too."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from subprocess import Popen, TimeoutExpired

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_vitscale._compat import SubprocessScriptLauncher, destroy_process_group_safely, on_child_failure
from lightning_vitscale.distributed.collective_guard import close_side_group

_registered_exit_cleanup = False
_EXIT_GRACE_S = 0.1  # for gloo's worker threads to drop the work objects of the last collectives
# The launching rank's time, once a child died, to start its own exception handling before it is killed.
NOTICE_GRACE_S = 30.0
_REAP_S = 10.0  # for the killed children to be reaped
# The other local ranks' time to end through their own handling after an error every rank raised (DDP: unbounded).
AGREED_GRACE_S = 60.0
# How long a child's failure waits to see whether this process raised the same agreed error.
_AGREEMENT_WINDOW_S = 5.0
# Set once this process handles an exception from the trainer: its watcher then leaves it alone.
_handling_exception = threading.Event()
# Set with it when that exception was raised on every rank: the other local ranks are then left to end themselves.
_agreed_exception = threading.Event()


class RaisedOnEveryRank(Exception):
    """Mixin for an exception every rank raises at the same point, decided by a collective (e.g. the non-finite
    guard's all-reduce): no rank is blocked in a collective, so each may end through its own handling, as under DDP."""


def destroy_process_group_at_exit() -> None:
    """Destroy the process group, and let gloo's worker threads settle, while Python is still fully alive:
    Lightning does so for NCCL only, and a gloo thread dropping a collective's last reference during interpreter
    teardown aborts the process (SIGABRT in ``AsyncAllgatherWork::~AsyncAllgatherWork``, seen in the demo)."""
    global _registered_exit_cleanup
    if not _registered_exit_cleanup:
        atexit.register(_exit_cleanup)
        _registered_exit_cleanup = True


def _exit_cleanup() -> None:
    close_side_group()  # the handshake group (collective_guard.py), while the group it was made under exists
    destroy_process_group_safely()
    time.sleep(_EXIT_GRACE_S)


def watch_local_ranks(launcher: object) -> None:
    """Let the launching rank finish its own exception handling when a child rank dies: Lightning's watcher SIGKILLs
    it (exit code 137, read as out-of-memory) within 5 s, even inside the user's ``except``/``finally``."""
    if isinstance(launcher, SubprocessScriptLauncher) and launcher.procs:
        _handling_exception.clear()
        _agreed_exception.clear()
        procs = launcher.procs
        on_child_failure(procs, lambda: _on_child_failure(procs, NOTICE_GRACE_S))


def _on_child_failure(procs: list[Popen], grace: float) -> None:
    """A child rank exited non-zero. After an error every rank raised the other children end through their own
    handling (``stop_local_ranks`` bounds them); a lone failure leaves them blocked in a collective: they are killed,
    and so is this process unless it starts handling an exception of its own within ``grace``."""
    if _handling_exception.wait(min(_AGREEMENT_WINDOW_S, grace)) and _agreed_exception.is_set():
        return
    _kill(procs)
    if not _handling_exception.wait(grace):
        os.kill(os.getpid(), signal.SIGKILL)


def stop_local_ranks(launcher: object, exception: BaseException, rank: int) -> None:
    """Stop the local ranks this process started: Lightning only does so on Ctrl+C, and a rank that raised
    leaves its peers blocked in a collective (or busy) with nobody to end them. The exception then propagates to
    the user's own handling, which runs to completion: the exit code is the script's, as under DDP."""
    agreed = isinstance(exception, RaisedOnEveryRank)
    if agreed:
        _agreed_exception.set()
    _handling_exception.set()
    if not (isinstance(launcher, SubprocessScriptLauncher) and launcher.procs):
        return
    if agreed:
        rank_zero_warn(f"{type(exception).__name__} on every rank: each ends through its own exception handling"
                       f" (the other local ranks are stopped if still running after {AGREED_GRACE_S:.0f} s).")
        # Not a daemon: this process's exit waits for it, so no child outlives the bound.
        threading.Thread(target=_kill, args=(launcher.procs, AGREED_GRACE_S), name="vitscale-reap").start()
        return
    rank_zero_warn(f"{type(exception).__name__} on rank {rank}: stopping the other local ranks.")
    _kill(launcher.procs)


def _kill(procs: list[Popen], grace: float = 0.0) -> None:
    """Wait up to ``grace`` seconds for ``procs`` to exit by themselves, then SIGKILL and reap what still runs."""
    _wait(procs, grace)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    _wait(procs, _REAP_S)  # SIGKILL cannot be caught: only an uninterruptible wait delays it


def _wait(procs: list[Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for proc in procs:
        with contextlib.suppress(TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
