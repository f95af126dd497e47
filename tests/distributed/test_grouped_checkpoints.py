"""Sharded checkpoints with several blocks per FSDP unit (``blocks_per_unit > 1``) on 2 gloo ranks, through
``Trainer.fit`` and ``ModelCheckpoint``: exact resume with the same or another ``blocks_per_unit`` (DDP as the
oracle for the steps after it), and the full ``model.state_dict()`` after fit."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks
from tests.helpers.results import max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
SCRIPT = "tests/distributed/scripts/grouped_checkpoints.py"
SCENARIOS = ("save_ddp", "resume_ddp_to_ddp", "save_k2", "resume_k2_to_k2", "resume_k2_to_k1", "save_k1",
             "resume_k1_to_k3", "full_state_dicts")
UNITS = {1: 5, 2: 3, 3: 3}  # 4 blocks: one unit per block, [2, 2] or [3, 1]; + the outer unit


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch_ranks(tmp_path_factory, "grouped_checkpoints", SCRIPT, ",".join(SCENARIOS))[1]


@pytest.mark.parametrize("saved, resumed", [(2, 2), (2, 1), (1, 3)])
def test_resume_restores_exactly_with_any_blocks_per_unit_and_continues_like_ddp(ranks, saved, resumed):
    """Saved with ``saved`` blocks per unit, resumed with ``resumed``: every weight and AdamW moment (and step
    count) equal to those at the save, bit for bit, the step count restored, and DDP's losses afterwards."""
    for rank in ranks:
        save, facts = rank[f"save_k{saved}"], rank[f"resume_k{saved}_to_k{resumed}"]
        assert save["units"] == UNITS[saved] and facts["units"] == UNITS[resumed]  # the grouping took effect
        assert save["optimizer_moments"] == 110  # exp_avg and exp_avg_sq of each of the 55 parameters
        assert facts["restored_entries"] == save["entries"] and facts["restored_differs"] == [], facts
        assert facts["start_step"] == 4 and facts["global_step"] == 8
        ddp = rank["resume_ddp_to_ddp"]
        assert ddp["restored_differs"] == [] and len(ddp["losses"]) == 4
        assert max_relative_difference(facts["losses"], ddp["losses"]) < 1e-6


def test_full_state_dict_after_fit_with_two_blocks_per_unit_is_ddps(ranks):
    """``model.state_dict()`` after fit: plain tensors with DDP's keys and values, bit for bit those of one block
    per unit."""
    for rank in ranks:
        facts = rank["full_state_dicts"]
        assert facts["keys_equal_ddp"] and facts["types"] == ["Tensor"]
        assert facts["differs_from_k1"] == []
        assert facts["largest_difference_from_ddp"] <= 1e-6
        assert max_relative_difference(rank["save_k2"]["losses"], rank["save_ddp"]["losses"]) < 1e-6
