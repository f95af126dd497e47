"""Compiled blocks (the CUDA default's block compile) train like DDP with dropout on, with and without activation
checkpointing: the recompute replays the forward's masks, and the blocks really run compiled code."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks
from tests.helpers.results import max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch_ranks(tmp_path_factory, "compiled_dropout", "tests/distributed/scripts/compiled_dropout.py",
                        timeout=540)[1]


@pytest.mark.parametrize("run", ["compiled_checkpointed", "compiled"])
def test_compiled_blocks_with_dropout_match_ddp(ranks, run):
    for rank in ranks:
        facts = rank[run]
        assert facts["checkpointed"] == (4 if run == "compiled_checkpointed" else 0)
        assert facts["graphs"] >= 1 and facts["graph_breaks"] == 0, facts  # compiled, in one piece
        assert max_relative_difference(facts["losses"], rank["ddp_losses"]) < 1e-4
        assert facts["weight_difference"] < 1e-3  # measured 1.8e-6 (inductor reorders fp32 sums)


def test_a_recompute_with_other_masks_would_be_seen(ranks):
    for rank in ranks:
        assert rank["control_weight_difference"] > 1e-2  # measured 0.023
