"""The chaos run, short: one classification job (``benchmarks/chaos_run.py``: ``VitScaleStrategy(async_save=True,
auto_resume=True)``, ``ShardedEMA``, tar shards streamed by loader workers, a ``ModelCheckpoint`` every 3 steps) on
2 CPU ranks, a random rank killed at least 8 times (SIGKILL, or SIGTERM) at random moments, every kind of moment
at least once (a random time, a step, a validation batch, a background checkpoint write, between the two steps of
a commit, a removal, a restore), the same command rerun after each kill as a cluster's requeue would. Its end
state (weights, optimizer states, schedule, EMA, the data stream's position, the loops) and every loss any
attempt logged are bit-equal to the same job run once without a kill, and every kill ends the whole job within
``ENDED_WITHIN_S``. ``benchmarks/chaos.py`` is the driver (its long run: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os

import pytest

from benchmarks.chaos import ENDED_WITHIN_S, Attempt, chaos, job, launch, run_attempt
from benchmarks.chaos_run import KINDS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
# 3 epochs of 12 steps (48 until issue 50): seed 8's 8 kills all land by step 18-22 (measured twice), so the last
# attempt still runs 14+ steps through validations, saves, removals and an epoch end; the test took 83 s alone
# (48 steps: 109 s in issue 49's smoke run of the same seed, 130 s in the full suite of cf2c4b0).
KILLS, STEPS = 8, 36
SEED = int(os.environ.get("VITSCALE_CHAOS_SEED", "8"))  # another seed: another set of moments


def test_a_run_killed_at_random_moments_ends_bit_equal_to_the_uninterrupted_run(tmp_path):
    report = chaos(tmp_path, kills=KILLS, steps=STEPS, seed=SEED, attempt_timeout=240)
    print(report.summary())
    for attempt in report.attempts:
        print(f"attempt {attempt.number}: {attempt.killed}, ended {attempt.ended_s} s later")
    assert len(report.kills) >= KILLS
    assert {kill["kind"] for kill in report.kills} == set(KINDS)
    assert all(a.ended_s is None or a.ended_s < ENDED_WITHIN_S for a in report.attempts)
    assert not report.differences, report.differences[:20]


def test_sigterm_to_one_rank_ends_the_job_in_seconds(tmp_path):
    """Lightning's SIGTERM handler broadcasts from rank 0 inside the handler: rank 1 signalled alone as a step began
    waited there while rank 0 waited in the step's collectives, until the process group's timeout (10 minutes).
    Mutation seen failing: the strategy's ``on_train_start`` without ``take_over_sigterm`` (the attempt hung)."""
    run, args = job(tmp_path / "run", 30, tmp_path / "cache")
    attempt = Attempt(1, {"attempt": 1, "kind": "step", "rank": 1, "at": 2, "signal": "SIGTERM"})
    run_attempt(run, args, attempt, timeout=90, start_job=launch)
    assert attempt.killed is not None and attempt.killed["step"] == 1, attempt.killed
    assert attempt.returncode != 0 and attempt.ended_s is not None and attempt.ended_s < 30, attempt
