"""fit/validate/test/predict, Lightning's own launcher, world size 1 and meta-device models."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.launch import assert_ok, launch_ranks, lightning_launch, slurm_launch
from tests.helpers.results import load_ranks, max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    scenarios = "lifecycle,meta_init,attention_auto"
    return launch_ranks(tmp_path_factory, "lifecycle", "tests/distributed/scripts/lifecycle.py", scenarios)[1]


def test_all_trainer_entry_points_work(ranks):
    """fit, validate, test and predict give DDP's numbers: same losses, accuracy and predictions per rank."""
    for rank in ranks:
        ours, ddp = rank["lifecycle"]["vitscale"], rank["lifecycle"]["ddp"]
        assert len(ours["preds"]) == 1  # 8 samples, batch 4, 2 ranks
        assert ours["preds"] == ddp["preds"]
        assert ours["test_acc"] == pytest.approx(ddp["test_acc"], abs=1e-6)
        assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
        assert ours["logged_train_loss"] == pytest.approx(ddp["logged_train_loss"], rel=1e-5)
        # validate/test reused the units made for fit (the planner's grouping, from the train dataloader's batch)
        assert ours["units_after_reuse"] == ours["units_after_fit"] <= 5
        assert ours["params_are_dtensors"]  # eval loops leave no gathered copy behind
    # sync_dist reduced the logged values to the same number on every rank; all_gather saw both ranks.
    facts = [rank["lifecycle"]["vitscale"] for rank in ranks]
    assert facts[0]["val_loss"] == facts[1]["val_loss"]
    assert facts[0]["logged_train_loss"] == facts[1]["logged_train_loss"]
    assert facts[0]["gathered"] == [0.0, 1.0]


def test_meta_model_is_materialised_shard_by_shard(ranks):
    for rank in ranks:
        facts = rank["meta_init"]
        assert facts["materialized"] and facts["finite"]
        assert facts["local_bytes"] <= 0.51 * facts["full_bytes"]
        # Budget: no rank may ever hold the full model. Peak RSS growth across setup + one validation step
        # stays under 3/4 of the unsharded size (measured: ~0.50).
        assert facts["peak_increase"] < 0.75 * facts["full_bytes"], facts


def test_auto_attention_is_decided_alike_on_every_rank(ranks):
    """Rank 0 timed the stand-in at 1 ms, rank 1 at 5 ms, SDPA at 2 ms on both: the sum (6 vs 4) says SDPA,
    and both ranks follow it, so no rank computes attention differently from the other."""
    lines = [rank["attention_auto"]["line"] for rank in ranks]
    assert lines[0] == lines[1]
    assert lines[0].startswith("sdpa (measured attention fwd+bwd per step: sdpa 4.000 ms, math 6.000 ms")
    assert [rank["attention_auto"]["stand_in_calls"] for rank in ranks] == [0, 0]


LAUNCHER = "tests/distributed/scripts/launcher.py"


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    """The launcher tests' jobs, at the same time (each its own folder and port; ~1-2 s each, mostly process
    start-up and teardown): the DDP oracle and the drop-in through Lightning's own launcher, world size 1 (a plain
    process), and 2 processes started as srun would (SLURM_* variables)."""
    out = {name: tmp_path_factory.mktemp(name) for name in ("ddp", "vitscale", "single", "slurm")}
    with ThreadPoolExecutor(max_workers=4) as pool:
        lightning = {name: pool.submit(lightning_launch, LAUNCHER, name, str(out[name]), timeout=180)
                     for name in ("ddp", "vitscale", "single")}
        slurm = pool.submit(slurm_launch, LAUNCHER, "vitscale", str(out["slurm"]), timeout=180)
        results = {name: future.result() for name, future in lightning.items()} | {"slurm": slurm.result()}
    return {name: (results[name], out[name]) for name in out}


@pytest.fixture(scope="module")
def ddp_run(launches):
    """The DDP oracle run once, through Lightning's own launcher, for every launcher test below."""
    result, out = launches["ddp"]
    assert_ok(result)
    return out


def test_dropin_with_lightning_launcher_matches_ddp(launches, ddp_run):
    result, out = launches["vitscale"]
    assert_ok(result)
    for rank in (0, 1):
        ddp = load_ranks(ddp_run, f"ddp_rank{rank}.json")[0]
        ours = load_ranks(out, f"vitscale_rank{rank}.json")[0]
        assert ours["strategy"] == "VitScaleStrategy"
        assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-5
        # The gloo group is destroyed before interpreter teardown (Lightning does so for NCCL only), so no
        # rank can abort at exit after a finished run.
        assert (out / f"vitscale_exit_rank{rank}.txt").read_text() == "group destroyed"


def test_world_size_one_matches_single_device(launches):
    result, out = launches["single"]
    assert_ok(result)
    facts = load_ranks(out, "single_rank0.json")[0]
    assert facts["vitscale"]["strategy"] == "VitScaleStrategy"
    assert max_relative_difference(facts["vitscale"]["losses"], facts["single_device"]["losses"]) < 1e-6


def test_under_slurm_matches_ddp(launches, ddp_run):
    """Processes started as srun would (SLURM_* variables): Lightning's SLURMEnvironment, our strategy."""
    results, out = launches["slurm"]
    for result in results:
        assert_ok(result)
    for rank in (0, 1):
        ddp = load_ranks(ddp_run, f"ddp_rank{rank}.json")[0]
        ours = load_ranks(out, f"vitscale_rank{rank}.json")[0]
        assert ours["cluster"] == "SLURMEnvironment"
        assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-5
