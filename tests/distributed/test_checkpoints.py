"""Sharded checkpoints on 2 gloo ranks: exact resume (DDP as the oracle), world-size changes, DDP upgrade path,
single-file export, crash safety and bad input."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import assert_ok, torchrun
from tests.helpers.results import load_ranks, max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
SCRIPT = "tests/distributed/scripts/checkpoints.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoints")
    assert_ok(torchrun(SCRIPT, "two", str(out), timeout=300))
    # The 1-rank job (it reads "two"'s checkpoint) and the job killed mid-save (its own A/B checkpoints) have nothing
    # in common: they run at the same time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        one = pool.submit(torchrun, SCRIPT, "one", str(out), nprocs=1, timeout=200)
        killed = pool.submit(torchrun, SCRIPT, "kill", str(out), timeout=200).result()
        assert_ok(one.result())
    assert not killed.timed_out and killed.returncode != 0 and (out / "kill_started").exists()
    assert_ok(torchrun(SCRIPT, "again", str(out), timeout=300))
    return tuple([out] + [load_ranks(out, f"{mode}-rank*.json") for mode in ("two", "one", "again")])


def snapshots_equal(a: Path, b: Path) -> None:
    saved, restored = torch.load(a), torch.load(b)
    assert saved.keys() == restored.keys() and len(saved) > 0
    different = [k for k in saved if not torch.equal(saved[k], restored[k])]
    assert not different, different[:5]


def test_resume_restores_exactly_and_continues_like_ddp(run):
    out, two, _, _ = run
    for rank, facts in enumerate(two):
        snapshots_equal(out / f"vitscale-saved-rank{rank}.pt", out / f"resume_vitscale-restored-rank{rank}.pt")
        ddp, ours = facts["resume_ddp"], facts["resume_vitscale"]
        assert ours["global_step"] == ddp["global_step"] == 16 and len(ours["losses"]) == 8
        assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-6


def test_ddp_checkpoint_resumes_under_vitscale(run):
    out, two, _, _ = run
    for rank, facts in enumerate(two):
        snapshots_equal(out / f"ddp-saved-rank{rank}.pt", out / f"ddp_to_vitscale-restored-rank{rank}.pt")
        assert max_relative_difference(facts["ddp_to_vitscale"]["losses"], facts["resume_ddp"]["losses"]) < 1e-6


def test_consolidated_checkpoint_resumes_under_ddp(run):
    out, two, _, _ = run
    for rank, facts in enumerate(two):
        snapshots_equal(out / f"vitscale-saved-rank{rank}.pt", out / f"consolidated_to_ddp-restored-rank{rank}.pt")
        resumed = facts["consolidated_to_ddp"]["losses"]
        assert max_relative_difference(resumed, facts["resume_vitscale"]["losses"]) < 1e-6


def test_resume_across_world_sizes(run):
    out, _, one, again = run
    snapshots_equal(out / "vitscale-saved-rank0.pt", out / "resume_2_to_1-restored-rank0.pt")  # 2 -> 1
    assert one[0]["resume_2_to_1"]["global_step"] == 16
    for rank, facts in enumerate(again):  # 1 -> 2
        snapshots_equal(out / "one-rank-saved.pt", out / f"resume_1_to_2-restored-rank{rank}.pt")
        assert facts["resume_1_to_2"]["global_step"] == 16


def test_consolidate_cli_gives_a_strict_plain_checkpoint_with_the_same_outputs(run, tmp_path):
    out, two, _, _ = run
    from lightning_vitscale.__main__ import main

    dst = tmp_path / "model.ckpt"
    assert main(["consolidate", str(out / "for-export.ckpt"), str(dst)]) == 0
    from tests.distributed.scripts.checkpoints import FIXED
    from tests.helpers.models import Classifier

    checkpoint = torch.load(dst, weights_only=False)
    assert all(v.dtype == torch.float32 for v in checkpoint["state_dict"].values() if v.is_floating_point())
    plain = Classifier("encoder")
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    plain.eval()
    with torch.no_grad():
        for rank, facts in enumerate(two):  # DistributedSampler gave rank r the samples r, r + 2, ...
            expected = torch.tensor(facts["sharded_logits"])
            torch.testing.assert_close(plain(FIXED[rank::2]), expected, rtol=1e-5, atol=1e-5)


def test_consolidate_refuses_an_incomplete_checkpoint(run, tmp_path, capsys):
    from lightning_vitscale.__main__ import main

    out, *_ = run
    assert main(["consolidate", str(out / "B.ckpt.partial"), str(tmp_path / "x")]) == 1
    assert "incomplete sharded checkpoint" in capsys.readouterr().err


def test_saving_gathers_nothing_and_each_rank_writes_its_share(run):
    _, two, _, _ = run
    for facts in two:
        assert facts["save_vitscale"]["save_collectives"] == {}  # no all-gather/reduce of tensors during save
        files = facts["save_memory"]["files"]
        shards = [size for name, size in files.items() if name.endswith(".distcp")]
        assert len(shards) == 2 and max(shards) <= 0.6 * sum(shards)


def test_crash_during_save_keeps_the_previous_checkpoints(run):
    _, _, _, again = run
    for facts in again:
        assert facts["after_kill"]["A"] == "loaded"
        assert facts["after_kill"]["B"] == "loaded"  # the complete B from before the crash
        assert "incomplete sharded checkpoint" in facts["after_kill"]["partial"]
        assert "save was interrupted" in facts["after_kill"]["partial"]


def test_fit_resumes_from_the_newest_complete_checkpoint(run):
    _, _, _, again = run
    for facts in again:
        found = facts["newest_complete"]
        assert found["last"]["start"] == 4 and found["last"]["path"].endswith("last.ckpt.partial")
        assert found["auto"]["start"] == 4, found["auto"]  # not 6: both step-6 checkpoints fail their CRC-32
        assert "needs `ModelCheckpoint(dirpath=...)`" in found["no_folder"]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "No checkpoint at"),
        ("garbage", "is not a readable checkpoint file (truncated or foreign?)"),
        ("foreign_dir", "is a folder but not a checkpoint"),
        ("mismatch_sharded", "does not match the model: missing (55)"),
        ("mismatch_full", "does not match the model: missing (55)"),
        ("shapes", "shape mismatch (54): backbone.encoder.layers.0.linear1.bias: checkpoint (128,) vs model (192,)"),
    ],
)
def test_bad_input_fails_on_every_rank_with_the_path_and_the_cause(run, case, message):
    _, two, _, _ = run
    for facts in two:
        error = facts["bad_inputs"][case]
        assert message in error, error
        assert "/" in error  # names the path
