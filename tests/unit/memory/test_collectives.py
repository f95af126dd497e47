"""One model of a unit's collectives: the planner's step cost and the setup summary's traffic report count the same
bytes (padded, per group, replicas included)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_vitscale._utils import shard_numel
from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory.collectives import unit_collectives
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_cost import rates_for, units_and_regather_seconds
from lightning_vitscale.memory.step_inputs import StepSettings
from lightning_vitscale.precision import resolve_flag
from lightning_vitscale.sharding.traffic import Unit, step_traffic

DEPTH = 3
CPU_RATES = rates_for("cpu")


@pytest.fixture(scope="module")
def inputs():
    with torch.device("meta"):
        planned = TinyViT(image=16, patch=4, dim=32, depth=DEPTH)
    return step_inputs(planned, torch.empty(2, 3, 16, 16, device="meta"), world_size=2, precision="bf16-mixed",
                       device="cpu")


def _sent(inputs, shard: int, replicas: int, reshard: bool) -> float:
    """Bytes one rank sends per step for the blocks, one unit each, as the traffic report counts them."""
    units = [Unit(tuple(torch.Size(s) for s in shapes), reshard) for shapes in inputs.layout.blocks]
    traffic = step_traffic(units, 0, resolve_flag("bf16-mixed"), shard * replicas, shard, shard * replicas, 0)
    return traffic.intra_node + traffic.inter_node


@pytest.mark.parametrize(("shard", "replicas"), [(2, 1), (3, 1), (2, 2)])  # on 3 ranks dim 0 is padded
def test_the_planners_collectives_are_the_traffic_reports(inputs, shard, replicas):
    grouped = replace(inputs, world=shard, replicas=replicas)
    padded = any(shard_numel(shapes, shard) * shard > sum(torch.Size(s).numel() for s in shapes)
                 for shapes in inputs.layout.blocks)
    assert padded == (shard == 3)
    link, rates = CPU_RATES.link_bytes_per_s, replace(CPU_RATES, regather_hidden=False, overlaps=False)
    for reshard in (True, False):
        settings = StepSettings(reshard_after_forward=reshard)
        fixed = DEPTH * (rates.unit_s + (rates.latency_s if reshard else 0.0))
        serial = units_and_regather_seconds(grouped, settings, rates)  # only the second all-gathers' bytes
        overlapped = units_and_regather_seconds(grouped, settings, replace(rates, overlaps=True))  # + one unit's
        per_unit = [unit_collectives(shapes, shard=shard, replicas=replicas, gather_itemsize=2, reduce_itemsize=4,
                                     reshard=reshard) for shapes in inputs.layout.blocks]
        regather = sum(c.sent for unit in per_unit for c in unit if c.kind == "regather")
        exposed = max(sum(c.sent for c in unit if c.kind != "regather") for unit in per_unit)
        assert serial == pytest.approx(fixed + regather / link)
        assert overlapped == pytest.approx(fixed + (regather + exposed) / link)
        # ... and the traffic report adds up the very same collectives.
        assert sum(c.sent for unit in per_unit for c in unit) == pytest.approx(_sent(inputs, shard, replicas, reshard),
                                                                                abs=DEPTH)
    # Replicas add their all-reduce to what a unit exposes; resharding adds its second all-gather.
    hybrid = units_and_regather_seconds(replace(inputs, replicas=2), StepSettings(), CPU_RATES)
    assert hybrid > units_and_regather_seconds(inputs, StepSettings(), CPU_RATES)
