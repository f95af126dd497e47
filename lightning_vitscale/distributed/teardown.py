"""How a run's processes end: the process group destroyed while Python is still alive (gloo's exit crash), and
the other local ranks stopped when one raises."""

from __future__ import annotations

import atexit
import signal
import time

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_vitscale._compat import SubprocessScriptLauncher, destroy_process_group_safely
from lightning_vitscale.distributed.collective_guard import close_side_group

_registered_exit_cleanup = False
# How long exiting waits for gloo's worker threads to drop the work objects of the last collectives.
_EXIT_GRACE_S = 0.1


def destroy_process_group_at_exit() -> None:
    """Destroy the process group, and let gloo's worker threads settle, while Python is still fully alive.

    Lightning registers the destroy for NCCL only. Under gloo the *worker thread* releases a finished
    collective's work object; if its reference is the last one and the release comes once interpreter teardown
    has begun, freeing the work's tensors needs a GIL it can no longer take and the process aborts ("terminate
    called without an active exception", SIGABRT in ``AsyncAllgatherWork::~AsyncAllgatherWork``; caught in a
    core dump of this project's demo on an oversubscribed 2-core machine). Gloo has no shutdown that joins its
    threads, so the exit handler gives them a short grace period to drop those references first.
    """
    global _registered_exit_cleanup
    if not _registered_exit_cleanup:
        atexit.register(_exit_cleanup)
        _registered_exit_cleanup = True


def _exit_cleanup() -> None:
    close_side_group()  # the handshake group (collective_guard.py), while the group it was made under exists
    destroy_process_group_safely()
    time.sleep(_EXIT_GRACE_S)


def stop_local_ranks(launcher: object, exception: BaseException, rank: int) -> None:
    """Stop the local ranks this process started: Lightning only does so on Ctrl+C, and a rank that raised
    leaves its peers blocked in a collective (or busy) with nobody to end them."""
    if isinstance(launcher, SubprocessScriptLauncher) and launcher.procs:
        rank_zero_warn(f"{type(exception).__name__} on rank {rank}: stopping the other local ranks.")
        launcher.kill(signal.SIGKILL)
