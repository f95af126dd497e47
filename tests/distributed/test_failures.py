"""A rank that raises or hangs must end the whole job in bounded time, under both launchers."""

from __future__ import annotations

import pytest

from tests.helpers.launch import lightning_launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_failing_rank_ends_the_job(tmp_path, mode):
    # The script's collective timeout is 8 s; "hang" needs it (rank 1 sleeps while rank 0 waits in an
    # all-gather), "raise" does not (the peer's exit ends the job). The test's own kill is at 150 s.
    result = lightning_launch("tests/distributed/scripts/launcher.py", mode, str(tmp_path), timeout=150)
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode != 0
    assert result.seconds < 90, f"took {result.seconds:.0f}s"
    expected = "rank 1 failed on purpose" if mode == "raise" else "Timed out"
    assert expected in result.output
