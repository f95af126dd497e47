"""Checkpoint habits from DDP on 2 gloo ranks, DDP as the oracle: lr_find, full single files and sharded folders
that ``load_from_checkpoint`` reads and DDP resumes from (a folder through ``consolidated`` and
``VitScaleCheckpointIO``), sharded checkpoints on fsspec URLs, crafted pickles, ``on_save_checkpoint`` /
``on_load_checkpoint`` editing what a resume loads."""

from __future__ import annotations

import pytest
import torch

import lightning_vitscale
from lightning_vitscale.__main__ import main
from tests.distributed.scripts.checkpoints import FIXED
from tests.helpers.launch import launch_ranks
from tests.helpers.models import Classifier
from tests.helpers.results import max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]
SCRIPT = "tests/distributed/scripts/checkpoint_dropin.py"
SCENARIOS = "lr_find,save_formats,resumes,crafted,scale_batch_size,remove_while_reading,checkpoint_hooks"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch_ranks(tmp_path_factory, "checkpoint_dropin", SCRIPT, SCENARIOS, timeout=360)


def test_lr_find_restores_and_suggests_like_ddp_and_leaves_no_folder(run):
    _, ranks = run
    for facts in ranks:
        ddp, ours = facts["lr_find"]["ddp"], facts["lr_find"]["vitscale"]
        assert ours["restored"] and ddp["restored"]  # weights back to the state before the sweep
        assert ours["lrs"] == ddp["lrs"] and len(ours["lrs"]) == 14
        assert max_relative_difference(ours["sweep_losses"], ddp["sweep_losses"]) < 1e-5
        assert ours["suggestion"] is not None and ours["suggestion"] == pytest.approx(ddp["suggestion"], rel=1e-6)
        assert ours["lr_used"] == ours["suggestion"]  # lr_find set it after restoring
        assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-5  # the real run after it
        assert ours["left"] == [] == ddp["left"]


def test_full_checkpoint_is_a_ddp_checkpoint(run):
    out, ranks = run
    ddp, ours = (torch.load(out / name, weights_only=True) for name in ("ddp.ckpt", "full.ckpt"))
    assert ranks[0]["save_formats"]["full_is_file"]
    assert ours["state_dict"].keys() == ddp["state_dict"].keys()
    for key, value in ddp["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][key], value, rtol=1e-5, atol=1e-6)
    (ours_opt,), (ddp_opt,) = ours["optimizer_states"], ddp["optimizer_states"]
    assert ours_opt["state"].keys() == ddp_opt["state"].keys()
    for index, state in ddp_opt["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(ours_opt["state"][index][name], value, rtol=1e-5, atol=1e-6)
    unchanged = [{k: v for k, v in g.items() if k != "foreach"} for g in ddp_opt["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "foreach"} for g in ours_opt["param_groups"]] == unchanged
    assert ours["lr_schedulers"] == ddp["lr_schedulers"] and ours["hyper_parameters"] == ddp["hyper_parameters"]


def logits(path) -> torch.Tensor:
    model = Classifier.load_from_checkpoint(path, map_location="cpu")  # a file, or a folder's consolidated()
    model.eval()
    with torch.no_grad():
        return model(FIXED)


def test_load_from_checkpoint_reads_a_full_file_like_ddp(run):
    out, _ = run
    torch.testing.assert_close(logits(out / "full.ckpt"), logits(out / "ddp.ckpt"), rtol=1e-5, atol=1e-6)


def test_load_from_checkpoint_reads_a_sharded_folder_like_ddps_file(run):
    out, ranks = run
    url = f"file://{out}/sharded.ckpt"
    told = [m for m in ranks[0]["save_formats"]["told"] if "consolidate" in m]
    assert len(told) == 1  # once per strategy, not at every save
    command = f"python -m lightning_vitscale consolidate {url} file://{out}/sharded.consolidated.ckpt"
    assert f"`{command}`" in told[0] and "load_from_checkpoint(lightning_vitscale.consolidated(path))" in told[0]
    assert "plugins=[lightning_vitscale.VitScaleCheckpointIO()]" in told[0]
    assert main(command.split()[3:]) == 0
    consolidated = logits(out / "sharded.consolidated.ckpt")
    torch.testing.assert_close(consolidated, logits(out / "ddp.ckpt"), rtol=1e-5, atol=1e-6)
    for path in (out / "sharded.ckpt", url):
        assert torch.equal(logits(lightning_vitscale.consolidated(path)), consolidated)


def test_fsspec_url_checkpoint_is_complete_and_atomic(run):
    _, ranks = run
    facts = ranks[0]["save_formats"]
    assert facts["sharded"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "lightning_vitscale.json", "meta.pt"]
    assert facts["stray"] == []  # no .partial left by the second save's swap


def test_resumes_from_full_files_and_urls_continue_like_ddp(run):
    _, ranks = run
    for facts in ranks:
        resumed = facts["resumes"]
        reference = resumed["ddp_from_ddp"]
        assert len(reference) == 4
        for case in ("ddp_from_full", "vitscale_from_full", "vitscale_from_url", "ddp_from_sharded"):
            assert max_relative_difference(resumed[case], reference) < 1e-5, case


def test_crafted_pickles_never_run_through_fit(run):
    _, ranks = run
    for facts in ranks:
        crafted = facts["crafted"]
        assert not crafted["ran"]
        errors = crafted["errors"]
        assert "Weights only load failed" in errors["ddp_full"]  # DDP: torch's default refuses it too
        for case in ("vitscale_full", "vitscale_meta", "ddp_meta"):
            assert "refuses (posix.system)" in errors[case] and "weights_only=False" in errors[case], errors[case]
        assert "refers to posix.system" in errors["vitscale_dcp"] and "refusing" in errors["vitscale_dcp"]


def test_resuming_a_fit_from_a_weights_only_checkpoint_fails_as_under_ddp(run):
    _, ranks = run
    for facts in ranks:
        errors = facts["crafted"]["errors"]
        assert errors["ddp_weights_only"].startswith("KeyError") and "save_weights_only" in errors["ddp_weights_only"]
        assert errors["vitscale_weights_only_full"] == errors["ddp_weights_only"]
        assert errors["vitscale_weights_only_sharded"] == errors["ddp_weights_only"]
        assert errors["ddp_weights_only_sharded"] == errors["ddp_weights_only"]  # never weights without optimizer


def test_scale_batch_size_is_refused_as_under_ddp(run):
    _, ranks = run
    for facts in ranks:
        messages = facts["scale_batch_size"]
        assert messages["vitscale"] == messages["ddp"]
        assert "not supported with distributed strategies" in messages["ddp"]


def test_a_sharded_folder_is_removed_only_once_every_rank_is_done_with_it(run):
    """Rank 1 still reads the folder when rank 0 is done and asks to remove it; rank 0's delete is slow. Without
    ``remove``'s first barrier rank 1's read fails (file gone); without its second, rank 1 returns from the
    removal while the folder still exists."""
    _, ranks = run
    for facts in ranks:
        for case in ("strategy", "function"):
            assert facts["remove_while_reading"][case] == {"load_error": None, "exists_on_return": False}, case


def test_on_load_checkpoint_sees_and_edits_the_state_dict_as_under_ddp(run):
    """``on_load_checkpoint`` reads ``checkpoint["state_dict"]`` and replaces an entry, then Lightning loads it:
    DDP's weights and losses from a sharded folder and from a full file; state of the module's own round-trips.
    Before: ``KeyError: 'state_dict'`` (the strategy had loaded the weights and dropped them from the dict).
    Removing an entry (a fresh head for fine-tuning, ``strict_loading = False``): a full file as under DDP; a
    sharded folder, read into the shards before the hook, refuses naming the fix."""
    _, ranks = run
    for facts in ranks:
        hooks = facts["checkpoint_hooks"]
        for edit in ("edit", "remove"):
            ddp = hooks[f"{edit}/ddp-sharded"]
            assert ddp["counter"] == 4 and ddp["queue"] == [4.0] * 3 and ddp["keys"] > 0
            kinds = ("sharded", "full") if edit == "edit" else ("full",)
            for kind in kinds:
                ours = hooks[f"{edit}/vitscale-{kind}"]
                assert (ours["counter"], ours["queue"], ours["keys"]) == (ddp["counter"], ddp["queue"], ddp["keys"])
                assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-6, (edit, kind)
                for name, values in ddp["head"].items():
                    assert ours["head"][name] == pytest.approx(values, abs=1e-6), (edit, kind, name)
        assert min(hooks["edit/ddp-sharded"]["head"]["bias"]) > 6.9  # the edit applied (7.0, then 2 SGD steps)
        refused = hooks["remove/vitscale-sharded"]["error"]
        assert "CheckpointError" in refused and "state_dict_type='full'" in refused and "consolidate" in refused
