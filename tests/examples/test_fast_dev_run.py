"""Each example runs one train+val batch as a user would launch it, under its default strategy (vitscale).

The same scripts under `--trainer.strategy=ddp` run in test_convergence.py (the DDP oracle runs); the ViTDet and
MViTv2-S models train under both strategies, with a validation batch, in test_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples._run import run_example

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


SMALL_DATA = ["--data.num_train=64", "--data.num_val=32"]  # the generated default is written as files: keep it small
CASES = {
    "classification": ("classification", []),
    "detection": ("detection", SMALL_DATA),
    "video": ("video", SMALL_DATA),
    "video-mvit_v2_s": ("video", [*SMALL_DATA, "--model.backbone=mvit_v2_s", "--data.batch_size=4"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_dev_run(case: str, tmp_path: Path) -> None:
    # vitscale is the scripts' default, so it is exercised by *not* passing --trainer.strategy
    task, extra = CASES[case]
    cache = [f"--data.cache_dir={tmp_path / 'cache'}"] if task != "classification" else []
    run = run_example(task, ["--trainer.fast_dev_run=true", *extra, *cache], tmp_path, timeout=100).check()
    assert "VitScaleStrategy: 2 rank(s)" in run.output
