"""``self.log(..., sync_dist=True)`` on 2 ranks of a sum over the sharded gradients and of a sharded weight's norm
(``Partial`` DTensors) logs DDP's values, under either plan; before: torch's "c10d.allreduce_.default does not have a
sharding strategy registered"."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/distributed/scripts/sync_dist_values.py"
CASES = ("logged",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    scenarios = ",".join(f"{case}/{strategy}" for case in CASES for strategy in ("ddp", "default", "memory"))
    return launch_ranks(tmp_path_factory, "sync_dist_values", SCRIPT, scenarios, timeout=240)[1]


@pytest.mark.parametrize("strategy", ["default", "memory"])
@pytest.mark.parametrize("case", CASES)
def test_logged_values_of_sharded_tensors_are_ddps(runs, case, strategy):
    for rank in runs:
        ddp, ours = rank[f"{case}/ddp"], rank[f"{case}/{strategy}"]
        assert len(ddp["losses"]) == 4
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
        assert len(ours["logged"]) == 4
        for step_ours, step_ddp in zip(ours["logged"], ddp["logged"]):
            assert step_ours == pytest.approx(step_ddp, rel=1e-5)
