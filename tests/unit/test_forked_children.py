"""Which children a rank's fork hook hands to the kernel to kill with their parent (``PR_SET_PDEATHSIG``): those
forked from the main thread while a process group of several ranks exists (data loader workers), and no other (a
thread's child would die when that thread ends; a daemon forked before or after a run must outlive it). The whole
path, a killed rank's busy workers, runs in ``tests/distributed/test_orphaned_workers.py``."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import pytest
import torch.distributed as dist

from lightning_vitscale.distributed import forked_children

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
_PR_GET_PDEATHSIG = 2


def child_death_signal() -> int:
    """Fork; the child exits with the signal it gets when its parent dies (0: none)."""
    pid = os.fork()
    if pid == 0:  # the child: no Python beyond this
        value = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(_PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
        os._exit(value.value)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def in_a_thread(function):
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


@pytest.fixture
def hooked():
    """The hook registered in this process (once, for good: inert here, where no group of several ranks exists)."""
    forked_children.end_forked_children_with_this_process()
    assert forked_children._owner == os.getpid()


def several_ranks(monkeypatch, world_size: int = 2) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)


def test_a_child_of_the_main_thread_dies_with_a_rank_of_several(hooked, monkeypatch):
    several_ranks(monkeypatch)
    assert child_death_signal() == 9  # SIGKILL


def test_a_child_of_another_thread_is_left_alone(hooked, monkeypatch):
    several_ranks(monkeypatch)
    assert in_a_thread(child_death_signal) == 0


@pytest.mark.parametrize("group", ["none", "one rank"])
def test_a_child_forked_without_a_group_of_several_ranks_is_left_alone(hooked, monkeypatch, group):
    if group == "one rank":
        several_ranks(monkeypatch, world_size=1)
    assert child_death_signal() == 0


def test_the_child_of_a_child_is_left_alone(hooked, monkeypatch):
    """Only the process that registered the hook: a worker's own children, a daemon's second fork, are its business."""
    several_ranks(monkeypatch)
    monkeypatch.setattr(forked_children, "_owner", os.getpid() + 1)
    assert child_death_signal() == 0
