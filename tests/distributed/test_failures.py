"""A rank that raises or hangs must end the whole job in bounded time, under both launchers, and leave rank 0's
own exception handling to run to completion with DDP's exit code.

The four jobs are independent (each its own launch, port and folder) and spend most of their time waiting (a
6 s handler, an 8 s collective timeout), so they run at the same time: ~12 s of wall time instead of ~31 s one
after the other. Each keeps its own bound (``seconds < 90``) and the launch helper's own timeout."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.launch import Finished, lightning_launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

# Longer than Lightning's 5 s poll of the child ranks, so a watcher that kills rank 0 always cuts the handler off.
HANDLER_S = "6"
FAILURES = "tests/distributed/scripts/failures.py"
JOBS = {
    # The script's collective timeout is 8 s: rank 1 sleeps while rank 0 waits in an all-gather.
    "hang": ("tests/distributed/scripts/launcher.py", "hang", "{out}"),
    "raise0": (FAILURES, "vitscale", "0", "{out}", HANDLER_S),
    "raise1": (FAILURES, "vitscale", "1", "{out}", HANDLER_S),
    "nan": (FAILURES, "vitscale", "nan", "{out}", "0.3"),
    "raise1_saving": (FAILURES, "vitscale", "1", "{out}", "0", "save"),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[Finished, Path]]:
    folders = {name: tmp_path_factory.mktemp(name) for name in JOBS}

    def launch(name: str) -> Finished:
        script, *args = JOBS[name]
        return lightning_launch(script, *(a.format(out=folders[name]) for a in args), timeout=150)

    with ThreadPoolExecutor(max_workers=len(JOBS)) as pool:
        results = dict(zip(JOBS, pool.map(launch, JOBS)))
    return {name: (results[name], folders[name]) for name in JOBS}


def test_hanging_rank_ends_the_job(jobs):
    result, _ = jobs["hang"]
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode != 0
    assert result.seconds < 90, f"took {result.seconds:.0f}s"
    assert "Timed out" in result.output


@pytest.mark.parametrize("raising_rank", [0, 1])
def test_raising_rank_leaves_rank0_handler_to_finish(jobs, raising_rank):
    # tests/distributed/scripts/failures.py: fit() raises at step 2 on `raising_rank`; rank 0's `except` sleeps
    # 6 s, then writes a file, and its `finally` another. DDP (same script, strategy="ddp") exits 1 with rank 0's
    # files written when rank 0 raises; when rank 1 raises, with a fast handler too (with a 6 s one Lightning's
    # watcher SIGKILLs rank 0 mid-handler: 137). The strategy must give 1 and rank 0's files in both cases.
    result, out = jobs[f"raise{raising_rank}"]
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode == 1, f"exit code {result.returncode}:\n{result.output[-3000:]}"
    assert (out / "handled_rank0.txt").exists(), result.output[-3000:]
    assert (out / "finally_rank0.txt").exists()
    assert f"rank {raising_rank} failed on purpose" in result.output
    assert result.seconds < 90, f"took {result.seconds:.0f}s"


def test_a_save_on_an_exception_one_rank_raised_alone_ends_the_job_in_seconds(jobs):
    """``OnExceptionCheckpoint`` on the rank that raised alone (rank 1, at step 2): its save would wait in collectives
    the other rank, inside its step, never joins, until the strategy's timeout (10 minutes: the whole job hung, and
    rank 0's own save the same). Now each rank asks the others within ``collective_guard.QUICK_JOIN_S``, saves
    nothing, warns, and the job ends as DDP's does (exit code 1). Mutation seen failing: the question never asked
    (``ExceptionSave.alone`` returning False: the launch timed out)."""
    result, out = jobs["raise1_saving"]
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode == 1, f"exit code {result.returncode}:\n{result.output[-3000:]}"
    assert "rank 1 failed on purpose" in result.output
    assert not (out / "saved" / "on_exception.ckpt").exists()
    assert result.seconds < 60, f"took {result.seconds:.0f}s"


def test_an_error_every_rank_raises_ends_every_rank_through_its_own_handler(jobs):
    # Rank 1's loss turns NaN from step 3; the non-finite guard's all-reduce makes both ranks raise
    # NonFiniteTrainingError at the same step. Each handler sleeps 0.3 s, then writes its files: under DDP, whose
    # ranks raising together both finish their handlers, rank 1's appear; before this, rank 0 killed rank 1.
    result, out = jobs["nan"]
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode == 1, f"exit code {result.returncode}:\n{result.output[-3000:]}"
    assert "NonFiniteTrainingError" in result.output
    for rank in (0, 1):
        assert (out / f"handled_rank{rank}.txt").read_text().startswith("Non-finite values"), rank
        assert (out / f"finally_rank{rank}.txt").exists(), rank
    assert result.seconds < 90, f"took {result.seconds:.0f}s"
