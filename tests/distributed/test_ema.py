"""ShardedEMA on 2 gloo ranks (and 1): a plain full-tensor EMA of the DDP run is the oracle, under DDP and under
VitScaleStrategy, through save, resume, a world-size change and export; no collective, 1/N of the bytes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.launch import assert_ok, torchrun
from tests.helpers.results import load_ranks, max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]
SCRIPT = "tests/distributed/scripts/ema.py"
TIGHT = 1e-6  # fp32: the same average up to the order of the roundings


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ema")
    assert_ok(torchrun(SCRIPT, "two", str(out), timeout=240))
    # Resumes of "two"'s checkpoints on 1 rank and on 4, at the same time (each writes its own files).
    with ThreadPoolExecutor(max_workers=2) as pool:
        one = pool.submit(torchrun, SCRIPT, "one", str(out), nprocs=1, timeout=120)
        four = pool.submit(torchrun, SCRIPT, "four", str(out), nprocs=4, timeout=120)
        assert_ok(one.result())
        assert_ok(four.result())
    return out, load_ranks(out, "two-rank*.json"), load_ranks(out, "one-rank*.json")


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and len(a) > 0, sorted(a.keys() ^ b.keys())[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_ema_equals_a_plain_ema_of_the_ddp_run(run):
    out, two, _ = run
    ddp_plain = torch.load(out / "ddp-plain-step4.pt")
    for rank, facts in enumerate(two):
        for name in ("ddp", "vitscale"):
            assert facts[f"save_{name}"]["updates"] == 4
            assert facts[f"save_{name}"]["oracle_diff"] < TIGHT  # against the plain EMA inside the same run
            ema = torch.load(out / f"{name}-ema-step4-rank{rank}.pt")
            assert largest_difference(ema, ddp_plain) < TIGHT  # against the plain EMA of the DDP run


def test_resume_restores_the_ema_exactly_and_continues_like_ddp(run):
    out, two, _ = run
    for rank, facts in enumerate(two):
        ddp_final = torch.load(out / f"resume_ddp-plain-final-rank{rank}.pt")
        for name in ("ddp", "vitscale"):
            saved = torch.load(out / f"{name}-ema-step4-rank{rank}.pt")
            restored = torch.load(out / f"resume_{name}-restored-rank{rank}.pt")
            assert largest_difference(saved, restored) == 0.0
            resumed = facts[f"resume_{name}"]
            assert resumed["global_step"] == 8 and resumed["updates"] == 8
            assert resumed["oracle_diff"] < TIGHT
            final = torch.load(out / f"resume_{name}-ema-final-rank{rank}.pt")
            assert largest_difference(final, ddp_final) < TIGHT
        assert max_relative_difference(facts["resume_vitscale"]["losses"], facts["resume_ddp"]["losses"]) < 1e-6


def test_a_ddp_checkpoint_resumes_with_its_ema_under_vitscale(run):
    out, two, _ = run
    for rank, facts in enumerate(two):
        saved = torch.load(out / f"ddp-ema-step4-rank{rank}.pt")
        assert largest_difference(saved, torch.load(out / f"ddp_to_vitscale-restored-rank{rank}.pt")) == 0.0
        assert facts["ddp_to_vitscale"]["updates"] == 5 and facts["ddp_to_vitscale"]["oracle_diff"] < TIGHT


def test_a_full_format_checkpoint_holds_the_whole_ema_and_resumes_it_exactly_on_1_2_4_ranks_and_ddp(run):
    """state_dict_type="full" must store whole EMA tensors (rank 0's shards alone lose half of them)."""
    out, two, one = run
    saved = torch.load(out / "vitscale-ema-step4-rank0.pt")
    in_file = torch.load(out / "vitscale-full-step4.ckpt")["ema_state_dict"]  # plain torch.load, weights_only
    assert largest_difference(in_file, saved) == 0.0
    resumes = [("full_vitscale", 2), ("full_ddp", 2), ("full_1", 1), ("full_4", 4)]
    for tag, ranks in resumes:
        for rank in range(ranks):
            restored = torch.load(out / f"{tag}-restored-rank{rank}.pt")
            assert largest_difference(restored, saved) == 0.0, (tag, rank)
    assert [two[r]["full_vitscale"]["updates"] for r in range(2)] == [5, 5] and one[0]["full_1"]["updates"] == 5


def test_resume_on_one_rank_from_a_two_rank_checkpoint(run):
    out, _, one = run
    saved = torch.load(out / "vitscale-ema-step4-rank0.pt")
    assert largest_difference(saved, torch.load(out / "resume_2_to_1-restored-rank0.pt")) == 0.0
    resumed = one[0]["resume_2_to_1"]
    assert resumed["global_step"] == 8 and resumed["updates"] == 8 and resumed["oracle_diff"] < TIGHT


def test_update_and_swap_issue_no_collective(run):
    _, two, _ = run
    for facts in two:
        for name in ("ddp", "vitscale"):
            saved = facts[f"save_{name}"]
            assert len(saved["update_collectives"]) >= 4 and set(saved["update_collectives"]) == {0}
            assert saved["swap_collectives"] == 0


def test_swap_puts_the_ema_in_and_the_raw_weights_back(run):
    _, two, _ = run
    for facts in two:
        for name in ("ddp", "vitscale"):
            assert facts[f"save_{name}"]["swap_inside_is_ema"] and facts[f"save_{name}"]["swap_restores_raw"]


def test_a_model_gathered_outside_a_step_serves_the_ema_inside_the_swap_and_the_raw_weights_after(run):
    """After ``fit`` a call with gradients enabled leaves the outer unit gathered; ``averaged`` must reshard it
    before swapping the EMA in (else the call inside sees the raw outer weights) and before swapping back (else
    the next call sees the EMA's)."""
    _, two, _ = run
    for facts in two:
        ddp, ours = (torch.tensor(facts[f"save_{name}"]["calls_around_swap"]) for name in ("ddp", "vitscale"))
        assert (ddp[1] - ddp[0]).abs().max() > 1e-3  # the EMA model really answers otherwise
        for call, name in enumerate(("before the swap", "inside the swap", "after the swap")):
            torch.testing.assert_close(ours[call], ddp[call], rtol=1e-5, atol=1e-6, msg=name)


def test_validation_logs_ema_and_raw_metrics_like_ddp(run):
    _, two, _ = run
    for facts in two:
        ours, ddp = facts["save_vitscale"]["metrics"], facts["save_ddp"]["metrics"]
        assert {"val_loss", "ema/val_loss"} <= ours.keys()
        assert ours["ema/val_loss"] != ours["val_loss"]  # the EMA pass really ran on other weights
        for key in ("val_loss", "ema/val_loss"):
            assert abs(ours[key] - ddp[key]) <= 1e-6 * abs(ddp[key])


def test_checkpointing_callbacks_act_once_per_validation_with_both_metrics(run):
    _, two, _ = run
    for facts in two:
        for name in ("ddp", "vitscale"):
            seen = facts[f"save_{name}"]["validation_end_seen"]
            assert seen == [{k: facts[f"save_{name}"]["metrics"][k] for k in ("val_loss", "ema/val_loss")}]


def test_ema_costs_four_bytes_per_parameter_over_world_size(run):
    _, two, _ = run
    for facts in two:
        memory = facts["save_vitscale"]["memory"]
        assert memory["ema_dtypes"] == ["torch.float32"]
        assert memory["ema_local"] == memory["ema_state_local"] == 4 * memory["param_local_numel"]
        assert memory["ema_full"] == 4 * memory["param_full_numel"]
        assert memory["ema_local"] <= 0.52 * memory["ema_full"]  # half, plus the replicated fp32 norms
        ddp = facts["save_ddp"]["memory"]
        assert ddp["ema_local"] == ddp["ema_full"]


def test_bf16_true_master_weights_get_an_fp32_ema(run):
    _, two, _ = run
    for facts in two:
        bf16 = facts["bf16_true"]
        assert "torch.bfloat16" in bf16["param_dtypes"] and bf16["ema_dtypes"] == ["torch.float32"]
        assert bf16["oracle_diff"] < TIGHT


def test_consolidate_exports_the_ema_or_the_raw_weights(run, tmp_path):
    from lightning_vitscale.__main__ import main
    from tests.helpers.models import Classifier

    out, _, _ = run
    saved = torch.load(out / "vitscale-ema-step4-rank0.pt")
    assert main(["consolidate", str(out / "vitscale-step4.ckpt"), str(tmp_path / "ema.ckpt"), "--weights", "ema"]) == 0
    assert main(["consolidate", str(out / "vitscale-step4.ckpt"), str(tmp_path / "raw.ckpt")]) == 0
    ema, raw = (torch.load(tmp_path / f"{w}.ckpt", weights_only=False) for w in ("ema", "raw"))
    assert largest_difference(ema["state_dict"], saved) == 0.0
    assert "optimizer_states" not in ema  # resuming from an average must fail loudly, not train on from it
    Classifier("encoder").load_state_dict(ema["state_dict"], strict=True)
    assert largest_difference(raw["ema_state_dict"], saved) == 0.0 and len(raw["optimizer_states"]) == 1
    assert largest_difference(raw["state_dict"], ema["state_dict"]) > 0


def test_consolidate_ema_of_a_checkpoint_without_one_names_the_fix(run, tmp_path, capsys):
    from lightning_vitscale.__main__ import main

    out, _, _ = run
    assert main(["consolidate", str(out / "plain-step4.ckpt"), str(tmp_path / "x.ckpt"), "--weights", "ema"]) == 1
    assert "--weights raw" in capsys.readouterr().err
