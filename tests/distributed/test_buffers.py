"""Buffers as under DDP on 2 CPU ranks: BatchNorm's running statistics are rank 0's on every rank (DDP broadcasts
them at each step's forward), and a checkpointed block updates them once per step, not again in its recompute.

A sharded checkpoint holds rank 0's buffers, as DDP's file does.

Mutations seen failing: the outer unit's buffer sync removed (rank 1's statistics and validation losses, and the
logged metric, differ from DDP's); the recompute's restore removed (the checkpointed run's statistics differ); the
sharded save's plain tensors left to every rank (DCP wrote rank 1's statistics: the resumed run's differ)."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch_ranks(tmp_path_factory, "buffers", "tests/distributed/scripts/buffers.py", "batchnorm,resume")[1]


@pytest.mark.parametrize("loop", ["automatic", "accumulating", "manual"])
@pytest.mark.parametrize("run", ["default", "checkpointed"])
def test_batchnorm_statistics_and_validation_are_ddps_on_every_rank(ranks, run, loop):
    """Rank 0's buffers where DDP has them: before a forward that follows a synced training step (not after a
    micro-batch in ``no_sync``, an evaluation step, or, under manual optimization, ever after the first), and once
    when ``validate`` sets up after the fit (Lightning's ``_sync_module_states``)."""
    for rank in ranks:
        ours, ddp = rank["batchnorm"][loop][run], rank["batchnorm"][loop]["ddp"]
        assert len(ours["losses"]) == 3 * (2 if loop == "accumulating" else 1) and len(ours["val_losses"]) >= 6
        assert ours["losses"] == ddp["losses"]  # training normalises with each batch's own statistics
        assert ours["seen"] == ddp["seen"]  # after each batch, training and validation
        assert ours["statistics"] == ddp["statistics"]
        assert ours["val_losses"] == ddp["val_losses"]
        assert ours["logged"] == ddp["logged"] and ours["validated"] == ddp["validated"]


@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_a_resumed_run_continues_from_the_statistics_ddp_saved(ranks, layout):
    for rank in ranks:
        ours, ddp = rank["resume"][layout], rank["resume"]["ddp"]
        assert len(ours["losses"]) == 2 and ours["losses"] == ddp["losses"]
        assert ours["statistics"] == ddp["statistics"]
