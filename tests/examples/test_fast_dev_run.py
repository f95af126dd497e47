"""Each example runs one train+val batch as a user would launch it, under its default strategy (vitscale).

The same scripts under `--trainer.strategy=ddp` run in test_convergence.py (the DDP oracle runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples._run import run_example

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


@pytest.mark.parametrize("task", ["classification", "detection", "video"])
def test_fast_dev_run(task: str, tmp_path: Path) -> None:
    # vitscale is the scripts' default, so it is exercised by *not* passing --trainer.strategy
    run = run_example(task, ["--trainer.fast_dev_run=true"], tmp_path, timeout=100).check()
    assert "VitScaleStrategy: 2 rank(s)" in run.output
