"""The gloo exit workaround: destroy the process group, and let gloo's threads settle, before interpreter teardown."""

from __future__ import annotations

import atexit
import time

from lightning_vitscale._compat import destroy_process_group_safely
from lightning_vitscale.collective_guard import close_side_group

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
