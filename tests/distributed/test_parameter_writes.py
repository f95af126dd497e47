"""A momentum encoder updated by user code on 2 ranks (``parameter_writes.py``): lightly's ``.data =`` and DINO's
in-place ``.data.mul_``, before, between or after the forwards of ``training_step`` or in ``on_train_batch_end``,
give DDP's losses and teacher bit for bit under ``VitScaleStrategy()`` (the outer unit and one grouped block unit,
kept gathered) and ``priority="memory"`` (a unit per block, resharded after forward).

Before: the teacher never moved under ``.data =`` (FSDP2's DTensors drop it), a write in ``training_step`` landed on
the outer unit's gathered copy and was freed with it, a block unit gathered early (prefetched as the step started,
or by the student's last block) computed on the teacher before the update, and a write to a unit kept gathered
for backward was lost at its reshard."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/distributed/scripts/parameter_writes.py"
CASES = ["lightly-start", "dino-between", "dino-end", "lightly-batch_end"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    scenarios = ",".join(f"{case}/{strategy}" for case in CASES for strategy in ("ddp", "default", "memory"))
    return launch_ranks(tmp_path_factory, "parameter_writes", SCRIPT, scenarios, timeout=240)[1]


@pytest.mark.parametrize("strategy", ["default", "memory"])
@pytest.mark.parametrize("case", CASES)
def test_a_momentum_encoder_updated_by_user_code_trains_as_under_ddp(runs, case, strategy):
    for rank in runs:
        ddp, ours = rank[f"{case}/ddp"], rank[f"{case}/{strategy}"]
        assert len(ddp["losses"]) == 4
        assert ours["losses"] == ddp["losses"]
        assert ours["teacher"] == ddp["teacher"]
