"""CPU ranks overlap FSDP2's collectives with compute (as CUDA streams do on a GPU) and still match DDP."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks
from tests.helpers.results import max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch_ranks(tmp_path_factory, "cpu_overlap", "tests/distributed/scripts/cpu_overlap.py")[1]


def test_reduce_scatters_run_while_earlier_blocks_compute_their_backward(ranks):
    """When the first block's backward finishes, the later blocks' reduce-scatters were issued and not waited
    for (a synchronous reduce-scatter would leave none in flight); none is left once backward returns."""
    for rank in ranks:
        assert len(rank["in_flight"]) == 4  # one backward per micro-batch: 1 + 1 + 2
        assert all(count >= 1 for count in rank["in_flight"][:2])
        assert rank["left_in_flight"] == 0
        assert "collectives         : asynchronous on CPU (all-gathers, reduce-scatters), prefetch 1" in rank["summary"]


def test_gradients_and_losses_match_ddp_also_when_accumulating(ranks):
    for rank in ranks:
        assert max_relative_difference(rank["losses"]["ours"], rank["losses"]["ddp"]) < 1e-5
        assert max(rank["grad_differences"]) < 1e-5


def test_reduce_scatters_move_a_reduce_scatters_bytes_and_equal_gloos(ranks):
    """gloo's reduce-scatter is an all-reduce of a clone (twice a reduce-scatter's bytes): CPU ranks reduce-scatter
    by gloo's all-to-all and a local sum instead, equal to gloo's for the sum and the average, fp32 and bf16;
    any other op falls back to gloo's own."""
    for rank in ranks:
        collectives = rank["collectives"]
        assert collectives.get("all_to_all_single", 0) == 5  # one per unit: 4 blocks and the outer unit
        assert not any(name.startswith("reduce_scatter") for name in collectives), collectives
        differences = rank["against_gloo"]
        assert len(differences) == 6, differences  # sum, avg, max x fp32, bf16
        assert all(value == 0.0 for value in differences.values()), differences
