"""A rank that raises or hangs must end the whole job in bounded time, under both launchers, and leave rank 0's
own exception handling to run to completion with DDP's exit code."""

from __future__ import annotations

import pytest

from tests.helpers.launch import lightning_launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

# Longer than Lightning's 5 s poll of the child ranks, so a watcher that kills rank 0 always cuts the handler off.
HANDLER_S = "6"


def test_hanging_rank_ends_the_job(tmp_path):
    # The script's collective timeout is 8 s: rank 1 sleeps while rank 0 waits in an all-gather.
    result = lightning_launch("tests/distributed/scripts/launcher.py", "hang", str(tmp_path), timeout=150)
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode != 0
    assert result.seconds < 90, f"took {result.seconds:.0f}s"
    assert "Timed out" in result.output


@pytest.mark.parametrize("raising_rank", [0, 1])
def test_raising_rank_leaves_rank0_handler_to_finish(tmp_path, raising_rank):
    # tests/distributed/scripts/failures.py: fit() raises at step 2 on `raising_rank`; rank 0's `except` sleeps
    # 6 s, then writes a file, and its `finally` another. DDP (same script, strategy="ddp") exits 1 with rank 0's
    # files written when rank 0 raises; when rank 1 raises, with a fast handler too (with a 6 s one Lightning's
    # watcher SIGKILLs rank 0 mid-handler: 137). The strategy must give 1 and rank 0's files in both cases.
    args = ("vitscale", str(raising_rank), str(tmp_path), HANDLER_S)
    result = lightning_launch("tests/distributed/scripts/failures.py", *args, timeout=150)
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode == 1, f"exit code {result.returncode}:\n{result.output[-3000:]}"
    assert (tmp_path / "handled_rank0.txt").exists(), result.output[-3000:]
    assert (tmp_path / "finally_rank0.txt").exists()
    assert f"rank {raising_rank} failed on purpose" in result.output
    assert result.seconds < 90, f"took {result.seconds:.0f}s"


def test_an_error_every_rank_raises_ends_every_rank_through_its_own_handler(tmp_path):
    # Rank 1's loss turns NaN from step 3; the non-finite guard's all-reduce makes both ranks raise
    # NonFiniteTrainingError at the same step. Each handler sleeps 0.3 s, then writes its files: under DDP, whose
    # ranks raising together both finish their handlers, rank 1's appear; before this, rank 0 killed rank 1.
    result = lightning_launch("tests/distributed/scripts/failures.py", "vitscale", "nan", str(tmp_path), "0.3",
                              timeout=150)
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode == 1, f"exit code {result.returncode}:\n{result.output[-3000:]}"
    assert "NonFiniteTrainingError" in result.output
    for rank in (0, 1):
        assert (tmp_path / f"handled_rank{rank}.txt").read_text().startswith("Non-finite values"), rank
        assert (tmp_path / f"finally_rank{rank}.txt").exists(), rank
    assert result.seconds < 90, f"took {result.seconds:.0f}s"
