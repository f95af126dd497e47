"""DDP is the oracle for the examples' bigger backbones: ViTDet and MViTv2-S train to DDP's losses under vitscale.

One launch of 2 CPU ranks; each model runs a few fp32 steps (and one validation batch) on its embedded default
data, read back from the files the datamodule wrote, under ``strategy="ddp"`` and under ``VitScaleStrategy``."""

from __future__ import annotations

import pytest

from tests.helpers.launch import assert_ok, torchrun
from tests.helpers.results import load_ranks, max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("examples_parity")
    result = torchrun("tests/examples/scripts/parity.py", str(out), str(out / "cache"), timeout=280)
    assert_ok(result)
    return load_ranks(out)


@pytest.mark.parametrize("model", ["vitdet", "mvit"])
def test_losses_match_ddp(ranks: list[dict], model: str) -> None:
    for rank in ranks:
        ddp, ours = rank[f"{model}/ddp"]["losses"], rank[f"{model}/vitscale"]["losses"]
        assert len(ours) == 4
        assert max_relative_difference(ours, ddp) < 1e-5, f"{model}: {ours} vs ddp {ddp}"


@pytest.mark.parametrize(("model", "blocks"), [("vitdet", {"WindowBlock": 4}), ("mvit", {"MultiscaleBlock": 16})])
def test_blocks_are_found_and_sharded(ranks: list[dict], model: str, blocks: dict[str, int]) -> None:
    for rank in ranks:
        found = rank[f"{model}/vitscale"]["blocks"]
        assert {k: v for k, v in found.items() if k in blocks} == blocks, found
