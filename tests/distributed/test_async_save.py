"""VitScaleStrategy(async_save=True) on 2 gloo ranks: the same checkpoints as synchronous saves (the copy to host
memory is taken at the save, before later steps change the parameters), the step goes on while a rank is still
writing, nothing is committed before every rank wrote, ``fit`` returns with the last save committed, and a failed
write is raised at the next step with the previous checkpoint intact."""

from __future__ import annotations

import pytest
import torch

from lightning_vitscale.checkpoint import load_consolidated
from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch_ranks(tmp_path_factory, "async_save", "tests/distributed/scripts/async_save.py",
                        pattern="async-rank*.json", timeout=200)


def tensors(folder) -> dict[str, torch.Tensor]:
    checkpoint = load_consolidated(folder)
    flat = dict(checkpoint["state_dict"])
    for i, state in enumerate(checkpoint["optimizer_states"]):
        flat.update({f"opt{i}.{p}.{k}": v for p, s in state["state"].items() for k, v in s.items()})
    return flat


def test_async_checkpoints_equal_the_synchronous_ones_bit_for_bit(run):
    out, ranks = run
    for step in (2, 4, 6):
        ours, oracle = tensors(out / "async" / f"step={step}.ckpt"), tensors(out / "sync" / f"step={step}.ckpt")
        assert ours.keys() == oracle.keys() and len(ours) > 10
        assert all(torch.equal(ours[k], oracle[k]) for k in ours), step
    assert all(facts["held"]["global_step"] == 6 for facts in ranks)


def test_the_step_goes_on_while_a_rank_writes_and_nothing_commits_before_every_rank_wrote(run):
    _, ranks = run
    held = ranks[1]["held"]
    assert held["saw_release"] is True  # released by step 3's end: the write ran while training went on
    assert held["writer_thread"] != "MainThread"
    assert held["committed_while_held"] is False  # rank 0 had written; the commit waited for rank 1


def test_a_failed_background_write_is_raised_at_the_next_step_and_the_previous_checkpoint_stays(run):
    out, ranks = run
    for facts in ranks:
        failing = facts["failing"]
        assert failing["error"] is not None and "No space left on device (injected)" in failing["error"]
        assert "rank 1" in failing["error"] and "async_save=False" in failing["error"]
        assert failing["raised_at_step"] == 5  # at the start of the step after the save at step 4, on every rank
    assert load_consolidated(out / "fail" / "last.ckpt")["global_step"] == 2
