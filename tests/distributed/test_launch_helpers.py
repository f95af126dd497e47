"""The shared rank launcher (tests/helpers/launch.py, ranks forked by tests/helpers/zygote.py): each rank runs its
script as ``python script.py`` under torchrun or Lightning's own launcher would, torchrun sees each rank's own exit
status, and a launch's timeout ends every rank."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import zygote
from tests.helpers.launch import REPO_ROOT, assert_ok, launch_ranks, lightning_launch, torchrun
from tests.helpers.results import load_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
SCRIPT = "tests/distributed/scripts/rank_view.py"
LIGHTNING_SCRIPT = "tests/distributed/scripts/lightning_rank_view.py"
CRASH_SCRIPT = "tests/distributed/scripts/crash_once.py"


def test_each_rank_runs_its_script_as_main_with_its_own_rank_and_exit_status(tmp_path):
    result = torchrun(SCRIPT, str(tmp_path), "extra", timeout=200)
    assert not result.timed_out, result.output[-4000:]
    assert result.returncode != 0 and "exitcode  : 3" in result.output, result.output[-4000:]  # rank 1's sys.exit(3)
    ranks = load_ranks(tmp_path)
    assert [r["local_rank"] for r in ranks] == [0, 1]
    assert [r["lightning_rank"] for r in ranks] == [0, 1]  # Lightning's rank_zero_only, read at import
    for rank in ranks:
        assert rank["argv"] == [str(tmp_path), "extra"] and rank["name"] == "__main__"
        assert Path(rank["file"]) == REPO_ROOT / SCRIPT and rank["cwd"] == str(REPO_ROOT)
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3
    # its exit waited for its non-daemon thread, then ran its atexit handler (a forked rank skips only the teardown)
    assert (tmp_path / "thread1.txt").read_text() == "written"
    assert (tmp_path / "atexit1.txt").read_text() == "thread done: True"


def test_lightning_launcher_starts_its_other_rank_as_python_script_py_would(tmp_path):
    assert_ok(lightning_launch(LIGHTNING_SCRIPT, str(tmp_path), "return", timeout=200))
    ranks = load_ranks(tmp_path)
    assert [r["local_rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["argv"] == [str(tmp_path), "return"] and rank["name"] == "__main__"
        assert Path(rank["file"]) == REPO_ROOT / LIGHTNING_SCRIPT
    if zygote.enabled():  # rank 1 too came from the zygote (through the wrapper rank 0's launcher ran), not rank 0
        assert ranks[0]["parent"] == ranks[1]["parent"] != os.getpid()


def test_a_timeout_ends_the_launcher_and_every_rank(tmp_path):
    # The ranks write their files well within it: forked from the zygote, a 2-rank torchrun launch that writes them
    # and exits takes ~1.5 s (the test above); fresh imports ~20 s.
    timeout = 8 if zygote.enabled() else 60
    result = torchrun(LIGHTNING_SCRIPT, str(tmp_path), "sleep", timeout=timeout)
    assert result.timed_out and result.seconds < timeout + 10, f"{result.seconds:.0f}s: a rank held the output"
    pids = [r["pid"] for r in load_ranks(tmp_path)]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in pids if os.path.exists(f"/proc/{pid}")]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"ranks {alive} outlived the launch"


def test_a_rank_that_crashes_once_is_reported_and_the_launch_runs_again(tmp_path, tmp_path_factory):
    """A native crash (gloo's abort) says where each crashed rank's threads were, then the launch runs once more."""
    marker = tmp_path / "crashed"
    said = r"(?s)a rank crashed; launched again.*Fatal Python error: Aborted.*crash_once"
    with pytest.warns(UserWarning, match=said):
        _, ranks = launch_ranks(tmp_path_factory, "crash_once", CRASH_SCRIPT, str(marker), timeout=120)
    assert marker.exists() and len(ranks) == 2


def test_a_rank_that_crashes_again_fails_the_launch_with_its_report_first(tmp_path_factory):
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match=r"^exit code 1:\nFatal Python error: Aborted"):
        launch_ranks(tmp_path_factory, "crash_always", CRASH_SCRIPT, "always", timeout=120)
