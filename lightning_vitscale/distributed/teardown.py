"""How a run's processes end: the process group destroyed while Python is still alive (gloo's exit crash), and
the other local ranks stopped when one raises, without cutting short the launching rank's own exception handling;
when every rank raised together (:class:`~lightning_vitscale.distributed.agreed.RaisedOnEveryRank`), each rank's
own handling runs to its end too."""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from subprocess import Popen, TimeoutExpired

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_vitscale._compat import SubprocessScriptLauncher, destroy_process_group_safely, on_child_failure
from lightning_vitscale.distributed.agreed import RaisedOnEveryRank
from lightning_vitscale.distributed.collective_guard import close_side_group

_registered_exit_cleanup = False
# How long exiting waits for gloo's worker threads to drop the work objects of the last collectives.
_EXIT_GRACE_S = 0.1
# How long the launching rank has, once a child rank died, to notice (a collective with the dead peer fails) and
# start its own exception handling before it is killed as Lightning's watcher would: bounded, never a hang.
NOTICE_GRACE_S = 30.0
# How long stopping the local ranks waits for the killed children to be reaped.
_REAP_S = 10.0
# How long the other local ranks have to finish their own exception handling after an error every rank raised,
# before they are killed: bounded, as DDP's is not.
AGREED_GRACE_S = 60.0
# How long a child's failure waits to see whether this process raised the same agreed error before killing the
# other children (lone failures: they are blocked in a collective).
_AGREEMENT_WINDOW_S = 5.0
# Set once this process handles an exception from the trainer: its watcher then leaves it alone.
_handling_exception = threading.Event()
# Set with it when that exception was raised on every rank: the other local ranks are then left to end themselves.
_agreed_exception = threading.Event()


def destroy_process_group_at_exit() -> None:
    """Destroy the process group, and let gloo's worker threads settle, while Python is still fully alive.

    Lightning registers the destroy for NCCL only. A gloo worker thread that drops a collective's last reference
    once interpreter teardown has begun aborts the process (SIGABRT in ``AsyncAllgatherWork::~AsyncAllgatherWork``,
    seen in a core dump of the demo on 2 cores); gloo cannot join its threads, so they get a short grace period.
    """
    global _registered_exit_cleanup
    if not _registered_exit_cleanup:
        atexit.register(_exit_cleanup)
        _registered_exit_cleanup = True


def _exit_cleanup() -> None:
    close_side_group()  # the handshake group (collective_guard.py), while the group it was made under exists
    destroy_process_group_safely()
    time.sleep(_EXIT_GRACE_S)


def watch_local_ranks(launcher: object) -> None:
    """Let the launching rank finish its own exception handling when a child rank dies.

    Lightning's watcher SIGKILLs this process (exit code 137, read as out-of-memory) within 5 s of a child's
    failure, even inside the user's ``except``/``finally`` around ``fit``. Here the failure goes to
    :func:`_on_child_failure` instead.
    """
    if isinstance(launcher, SubprocessScriptLauncher) and launcher.procs:
        _handling_exception.clear()
        _agreed_exception.clear()
        procs = launcher.procs
        on_child_failure(procs, lambda: _on_child_failure(procs, NOTICE_GRACE_S))


def _on_child_failure(procs: list[Popen], grace: float) -> None:
    """A child rank exited non-zero. After an error every rank raised (at the same step) the other children end
    through their own handling (``stop_local_ranks`` bounds them). A lone failure leaves them blocked in a
    collective: they are killed, and so is this process unless it starts handling an exception of its own within
    ``grace`` (a collective with the dead peer fails at once), so a rank stuck outside collectives still ends."""
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
        threading.Thread(target=_reap, args=(launcher.procs, AGREED_GRACE_S), name="vitscale-reap").start()
        return
    rank_zero_warn(f"{type(exception).__name__} on rank {rank}: stopping the other local ranks.")
    _kill(launcher.procs)


def _reap(procs: list[Popen], grace: float) -> None:
    """Wait up to ``grace`` seconds for ``procs`` to exit by themselves, then kill what still runs."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except TimeoutExpired:
            break
    _kill(procs)


def _kill(procs: list[Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + _REAP_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except TimeoutExpired:  # pragma: no cover - SIGKILL cannot be caught; only an uninterruptible wait delays it
            pass
