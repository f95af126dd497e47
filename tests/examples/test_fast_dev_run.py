"""Every example and backbone choice runs through its CLI under ``"ddp"`` and ``"vitscale"`` (the default), and DDP
is the oracle: the same losses under both.

One launch of ``scripts/example_clis.py`` on 2 CPU ranks runs all eight fits (classification's ViT; detection's
ViTDet backbone; video's factorised ViT and ``--model.backbone=mvit_v2_s``), each the CLI's ``fast_dev_run``, fp32,
on its embedded default data: detection and video read back the files their datamodules wrote. ViTDet and MViTv2-S
run 4 steps (and 4 validation batches) so their losses are compared over a few optimizer steps, not only the first.
The scripts launched as a user would (``python examples/<task>.py fit``) run in test_convergence.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.launch import assert_ok, torchrun
from tests.helpers.results import load_ranks, max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

SCRIPT = "tests/examples/scripts/example_clis.py"
CASES = {"classification": 1, "detection": 4, "video": 1, "video-mvit_v2_s": 4}  # case -> batches run
STRATEGIES = {"vitscale": "VitScaleStrategy", "ddp": "DDPStrategy"}
# the repeated blocks each backbone is sharded by (the pyramid's and head's repeated conv stacks aside)
BLOCKS = {
    "classification": {"Block": 4},
    "detection": {"WindowBlock": 4},
    "video": {"Block": 8},
    "video-mvit_v2_s": {"MultiscaleBlock": 16},
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    out, work = tmp_path_factory.mktemp("example_clis"), tmp_path_factory.mktemp("work")
    names = [f"{case}/{s}" for case in CASES for s in STRATEGIES]
    result = torchrun(SCRIPT, str(out), str(work), ",".join(names), timeout=360)
    assert_ok(result)
    return load_ranks(out), result.output


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_dev_run(launch: tuple[list[dict], str], case: str, strategy: str) -> None:
    for rank in launch[0]:
        run = rank[f"{case}/{strategy}"]
        assert run["strategy"] == STRATEGIES[strategy] and run["precision"] == "32-true"
        assert run["steps"] == CASES[case] and len(run["losses"]) == CASES[case]
        assert run["val_batches"] == CASES[case]
        if strategy == "vitscale":
            assert {k: v for k, v in run["blocks"].items() if k in BLOCKS[case]} == BLOCKS[case], run["blocks"]


def test_vitscale_prints_its_setup_summary_once_per_fit(launch: tuple[list[dict], str]) -> None:
    assert launch[1].count("VitScaleStrategy: 2 rank(s), precision 32-true") == len(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_match_ddp(launch: tuple[list[dict], str], case: str) -> None:
    # same seed, data and initial weights: only the float reduction order differs (measured ~2e-7 relative)
    for rank in launch[0]:
        ddp, ours = rank[f"{case}/ddp"]["losses"], rank[f"{case}/vitscale"]["losses"]
        assert max_relative_difference(ours, ddp) < 1e-5, f"{case}: {ours} vs ddp {ddp}"
