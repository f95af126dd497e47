"""The video example's ``--model.backbone=mvit_v2_s`` runs through its CLI under ``"ddp"`` and ``"vitscale"`` (the
default), and DDP is the oracle: the same losses under both.

Its two fits run in the launch of ``scripts/examples_matrix.py`` (2 CPU ranks) that test_backbones_and_pretraining.py
reads too (``example_fits``, tests/examples/conftest.py): the CLI's ``fast_dev_run``, fp32, on its embedded default
data (the mp4 files its datamodule wrote), 4 steps (and 4 validation batches) so its losses are compared over a few
optimizer steps, not only the first.

The other examples' defaults (classification's ViT, detection's ViTDet backbone, video's factorised ViT) ran here
too until 2026-11-28: each fit's strategy, precision, sharded blocks and first steps' losses against DDP's. They are
checked in test_convergence.py instead, on runs launched as a user would (``python examples/<task>.py fit``), whose
losses are compared with DDP's at every step of a whole epoch (>= 16 steps, not 1-4) and whose output must hold
one setup summary naming the same blocks and precision.
"""

from __future__ import annotations

import pytest

from tests.examples.conftest import FITS
from tests.helpers.results import max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

CASE, STEPS = "video-mvit_v2_s", 4  # batches run (scripts/examples_matrix.py: MVIT_STEPS)
STRATEGIES = {"vitscale": "VitScaleStrategy", "ddp": "DDPStrategy"}
BLOCKS = {"MultiscaleBlock": 16}  # the repeated blocks the backbone is sharded by (its head aside)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_fast_dev_run(example_fits: tuple[list[dict], str], strategy: str) -> None:
    for rank in example_fits[0]:
        run = rank[f"{CASE}/{strategy}"]
        assert run["strategy"] == STRATEGIES[strategy] and run["precision"] == "32-true"
        assert run["steps"] == STEPS and len(run["losses"]) == STEPS
        assert run["val_batches"] == STEPS
        if strategy == "vitscale":
            assert {k: v for k, v in run["blocks"].items() if k in BLOCKS} == BLOCKS, run["blocks"]


def test_vitscale_prints_its_setup_summary_once_per_fit(example_fits: tuple[list[dict], str]) -> None:
    # one vitscale fit per entry of FITS in the launch (the ddp fits print none), each planned from its measured
    # step: MViTv2-S's blocks take ``(x, thw)``, which the planner could not replay until 2026-12-03 (every block
    # checkpointed instead of the speed-first plan)
    assert example_fits[1].count("VitScaleStrategy: 2 rank(s), precision 32-true") == len(FITS)
    assert example_fits[1].count("through training_step") == len(FITS) and "could not run" not in example_fits[1]


def test_losses_match_ddp(example_fits: tuple[list[dict], str]) -> None:
    # same seed, data and initial weights: only the float reduction order differs (measured ~2e-7 relative)
    for rank in example_fits[0]:
        ddp, ours = rank[f"{CASE}/ddp"]["losses"], rank[f"{CASE}/vitscale"]["losses"]
        assert max_relative_difference(ours, ddp) < 1e-5, f"{CASE}: {ours} vs ddp {ddp}"
