"""A rank killed while its data loader workers are busy ends the whole job in seconds
(``tests/distributed/scripts/orphaned_workers.py``: rank 0 SIGKILLed as step 2 begins, its two workers inside a
5-minute ``__getitem__``). Forked after the process group was made, the workers hold copies of rank 0's sockets; they
now die with it, so rank 1's collective fails at once. Before, rank 1 waited in the step's all-gather until the
workers returned (most likely the chaos test's one straggler, 45 s after a kill); ``strategy="ddp"`` still does (seen:
rank 1 and both of rank 0's workers alive 60 s after the kill). Mutation seen failing: ``start_process_group``
without ``end_forked_children_with_this_process``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.launch import REPO_ROOT, Identity, alive, descendants, free_port, python_command, read_identity

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SCRIPT = "tests/distributed/scripts/orphaned_workers.py"
# Rank 1's own exit joins each of its two busy workers for torch's 5 s before killing it: ~10 s here.
ENDED_WITHIN_S = 30.0
PROCESSES = {"rank0", "rank1", "worker-rank0-0", "worker-rank0-1", "worker-rank1-0", "worker-rank1-1"}


def recorded(folder: Path) -> dict[str, Identity]:
    """Each process's pid and start time, as it wrote them (``launch.record_identity``)."""
    found = {path.name: read_identity(path) for path in folder.iterdir()}
    return {name: identity for name, identity in found.items() if identity is not None}


def test_a_rank_killed_while_its_loader_workers_are_busy_ends_the_job_in_seconds(tmp_path):
    cmd, env = python_command(SCRIPT, "vitscale", str(tmp_path), MASTER_PORT=str(free_port()))
    processes: dict[str, Identity] = {}
    with open(tmp_path / "job.log", "w") as log:  # not a pipe: an orphaned worker would keep it open
        job = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    try:
        job.wait(120)  # rank 0, the launching process, is killed at step 2
        processes = recorded(tmp_path / "pids")
        deadline = time.monotonic() + ENDED_WITHIN_S
        while any(alive(p) for p in processes.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        still = sorted(name for name, process in processes.items() if alive(process))
        output = (tmp_path / "job.log").read_text()[-3000:]
        assert set(processes) == PROCESSES, output
        assert job.returncode == -signal.SIGKILL, output
        assert not still, f"{still} still ran {ENDED_WITHIN_S:.0f} s after rank 0 was killed:\n{output}"
    finally:
        leftovers = [pid for pid, started in processes.values() if alive((pid, started))]
        for pid in [*([job.pid, *descendants(job.pid)] if job.poll() is None else []), *leftovers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.wait()
