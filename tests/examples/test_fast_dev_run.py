"""Each example runs one train+val batch as a user would launch it, under vitscale and unchanged under ddp."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples._run import run_example

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


@pytest.mark.parametrize("strategy", ["vitscale", "ddp"])
@pytest.mark.parametrize("task", ["classification", "detection", "video"])
def test_fast_dev_run(task: str, strategy: str, tmp_path: Path) -> None:
    # vitscale is the scripts' default, so it is exercised by *not* passing --trainer.strategy
    extra = [] if strategy == "vitscale" else [f"--trainer.strategy={strategy}"]
    run_example(task, ["--trainer.fast_dev_run=true", *extra], tmp_path, timeout=100).check()
