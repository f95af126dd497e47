"""The shared rank launcher (tests/helpers/launch.py, ranks forked by tests/helpers/zygote.py): each rank runs its
script as ``python script.py`` under torchrun would, and torchrun sees each rank's own exit status."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.launch import REPO_ROOT, torchrun
from tests.helpers.results import load_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
SCRIPT = "tests/distributed/scripts/rank_view.py"


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
