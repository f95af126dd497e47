"""Processes a rank forks end with it. A data loader worker forked after the process group was made holds copies
of the rank's sockets (gloo's pairs, the store's connections): when the rank is killed (out of memory, preempted),
its peers see it gone only once every such copy is closed. An idle worker notices its dead parent within 5 s
(torch's watchdog); one busy in a ``__getitem__`` (a slow decode, a remote read) does not look until it returns,
and the peers wait in their collective meanwhile, up to the process group's timeout (30 minutes by default): a
killed job that never ends, under DDP too. Each child forked from the rank's main thread while its process group
exists is therefore killed by the kernel as its parent dies (``PR_SET_PDEATHSIG``), and the peers' collectives fail
at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

import torch.distributed as dist

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_owner: int | None = None  # the rank process that registered the hook; its children's own forks are left alone
_forking: int | None = None  # set before a fork this module handles: the parent's pid, read in the child
_libc: ctypes.CDLL | None = None


def end_forked_children_with_this_process() -> None:
    """From now on, children this process forks from its main thread while its process group exists die with it
    (Linux; elsewhere nothing changes). The fork hook is process-wide and cannot be removed: it acts only while the
    group exists, and only in this process (a worker's own children, a daemon's double fork, are left alone)."""
    global _owner, _libc
    if _owner is not None or sys.platform != "linux":
        return
    try:
        _libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child runs as little as possible
    except OSError:
        return
    _owner = os.getpid()
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _before_fork() -> None:
    global _forking
    # PR_SET_PDEATHSIG follows the forking *thread*: a child of a thread that ends before the process would die
    # early, so only the main thread's children (the loops' data loader workers) are handled.
    handled = (os.getpid() == _owner and threading.current_thread() is threading.main_thread()
               and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)  # fmt: skip
    _forking = os.getpid() if handled else None


def _after_fork_in_child() -> None:
    global _forking
    parent, _forking = _forking, None
    if parent is None or _libc is None:
        return
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused (a sandbox): the worker keeps torch's own watchdog
    if os.getppid() != parent:  # the parent died between the fork and the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
