"""DDP is the oracle: VitScaleStrategy must train four kinds of backbone to the same losses, step for step."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks
from tests.helpers.results import max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

BACKBONES = ("encoder", "timm", "hf", "resnet")
CONFIGS = ("plain", "accum_clip", "multicrop")
# One backbone each: selective checkpointing + 4 micro-batches per step; 2 blocks per FSDP unit + accumulation + clip.
EXTRA = ("encoder/selective_accum4", "timm/grouped_accum_clip")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch_ranks(
        tmp_path_factory, "parity", "tests/distributed/scripts/parity.py", ",".join(BACKBONES), ",".join(CONFIGS),
        ",".join(EXTRA), timeout=540,
    )[1]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_losses_match_ddp(ranks, backbone, config):
    for rank in ranks:
        ddp, ours = rank[f"{backbone}/{config}/ddp"], rank[f"{backbone}/{config}/vitscale"]
        assert len(ours["losses"]) >= 4  # 4 optimizer steps (8 micro-batches with accumulation)
        assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-5
        # ... with the CPU ranks' asynchronous collectives on (the default), through Trainer.fit.
        assert ours["overlap"] == "asynchronous on CPU (all-gathers, reduce-scatters), prefetch 1"


@pytest.mark.parametrize("backbone", BACKBONES)
def test_every_block_is_its_own_unit_and_checkpointed(ranks, backbone):
    """The recipe (``priority="memory"``): each of the 4 blocks is an FSDP unit and recomputes its forward in
    backward; the root is a unit too."""
    for rank in ranks:
        facts = rank[f"{backbone}/plain/vitscale"]
        assert facts["num_blocks"] == 4
        assert facts["fsdp_blocks"] == 4 and facts["root_fsdp"]
        assert facts["recomputed_blocks"] == 4


@pytest.mark.parametrize("backbone", BACKBONES)
def test_each_rank_holds_about_half(ranks, backbone):
    for rank in ranks:
        assert rank[f"{backbone}/plain/vitscale"]["sharded_fraction"] <= 0.55
        assert rank[f"{backbone}/plain/ddp"]["sharded_fraction"] == 1.0


def test_selective_checkpointing_and_unsharded_accumulation_match_ddp(ranks):
    """Selective checkpointing with 4 micro-batches per optimizer step: DDP's losses, and one reduce-scatter per
    FSDP unit per optimizer step (the first three micro-batches accumulate unsharded gradients, as DDP's
    ``no_sync``), where a reduce-scatter per micro-batch would send four."""
    for rank in ranks:
        ddp, ours = rank["encoder/selective_accum4/ddp"], rank["encoder/selective_accum4/vitscale"]
        assert len(ours["losses"]) == 16 and ours["optimizer_steps"] == 4
        assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-5
        assert ours["selective"] == 4 and ours["recomputed_blocks"] == 4
        assert ours["reduce_scatters"] == ours["units"] * ours["optimizer_steps"]
        assert "one reduce-scatter per optimizer step" in ours["accumulation"]


def test_two_blocks_per_unit_match_ddp(ranks):
    """``blocks_per_unit=2``: 4 checkpointed blocks in 2 units (+ the outer unit), with 2 micro-batches per
    optimizer step and gradient clipping: DDP's losses, and one reduce-scatter per unit per optimizer step, 3
    where one unit per block would send 5."""
    for rank in ranks:
        ddp, ours = rank["timm/grouped_accum_clip/ddp"], rank["timm/grouped_accum_clip/vitscale"]
        assert ours["optimizer_steps"] == 4 and ours["units"] == 3
        assert max_relative_difference(ours["losses"], ddp["losses"]) < 1e-5
        assert ours["fsdp_blocks"] == 4 and ours["recomputed_blocks"] == 4
        assert ours["reduce_scatters"] == 3 * ours["optimizer_steps"]
