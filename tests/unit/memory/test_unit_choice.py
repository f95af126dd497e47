"""``blocks_per_unit=None`` with the user's checkpointing: the planner's grouping, on one process (fake tensors)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory.plan_search import BlockPlan, reshard_boundaries
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_cost import CPU_RATES, GPU_RATES, units_and_regather_seconds
from lightning_vitscale.memory.step_model import StepSettings, predict_step
from lightning_vitscale.memory.unit_choice import choose_blocks_per_unit

DEPTH = 6


@pytest.fixture(scope="module")
def inputs():
    with torch.device("meta"):
        planned = TinyViT(image=32, patch=4, dim=256, depth=DEPTH)
    return step_inputs(planned, torch.empty(8, 3, 32, 32, device="meta"), world_size=2, precision="32-true",
                       device="cpu")


EVERY = StepSettings(frozenset(range(DEPTH)))  # the recipe: every block checkpointed, blocks resharded


def peak(inputs, k: int) -> int:
    return predict_step(inputs, replace(EVERY, blocks_per_unit=k)).peak


def test_fewer_units_where_memory_allows_when_collectives_do_not_overlap(inputs):
    """Where the step's thread waits for every collective (CPU ranks before sharding/cpu_overlap.py), a unit's
    fixed cost is all there is: all 6 blocks in one unit when the budget allows, the largest that fits below
    that, one block per unit when nothing larger fits."""
    serial = replace(CPU_RATES, overlaps=False)
    ample = choose_blocks_per_unit(inputs, EVERY, 2**40, serial)
    # 5 units fewer: their fixed cost and the fixed part of their second all-gather (blocks reshard); the bytes
    # gathered again are the same whatever the grouping.
    assert ample.per_unit == DEPTH
    assert ample.saved_seconds == pytest.approx((DEPTH - 1) * (serial.unit_s + serial.latency_s))
    assert f"planner: predicted {ample.saved_seconds * 1e3:.1f} ms per step less than one block" in ample.describe()
    assert peak(inputs, 1) < peak(inputs, 2) < peak(inputs, 3) < peak(inputs, DEPTH)
    assert choose_blocks_per_unit(inputs, EVERY, peak(inputs, 3), serial).per_unit == 3
    tight = choose_blocks_per_unit(inputs, EVERY, peak(inputs, 2) - 1, serial)
    assert tight.per_unit == 1 and tight.saved_seconds == 0 and "no larger unit fits" in tight.describe()


@pytest.mark.parametrize("rates", [GPU_RATES, CPU_RATES], ids=["gpu", "cpu"])
def test_where_collectives_overlap_compute_a_large_unit_exposes_its_all_gather(inputs, rates):
    """With collectives beside compute (GPU streams; CPU ranks' asynchronous gloo) a unit's fixed cost is small
    and the first unit's all-gather and the last one's reduce-scatter have nothing to hide behind: the choice
    weighs both (checked against the formula; a resharded unit's second gather hides only on a GPU)."""
    for k in (1, 2, 3, DEPTH):
        settings = replace(EVERY, blocks_per_unit=k)
        block = sum(torch.Size(s).numel() for s in inputs.layout.blocks[0]) * 4
        units = -(-DEPTH // k)
        exposed = 2 * k * block * (2 - 1) / 2 / rates.link_bytes_per_s
        regather = 0.0 if rates.regather_hidden else units * k * block / 2 / rates.link_bytes_per_s
        expected = units * (rates.unit_s + rates.latency_s) + exposed + regather
        assert units_and_regather_seconds(inputs, settings, rates) == pytest.approx(expected)
    seconds = {k: units_and_regather_seconds(inputs, replace(EVERY, blocks_per_unit=k), rates)
               for k in (1, 2, 3, DEPTH)}
    assert choose_blocks_per_unit(inputs, EVERY, 2**40, rates).per_unit == min(seconds, key=seconds.get)
    if rates is CPU_RATES:  # measured best on the 2-core CPU (benchmarks/RESULTS.md): neither extreme
        assert min(seconds, key=seconds.get) == 2




def test_units_stay_gathered_for_backward_where_memory_allows_and_the_reshard_is_left_to_the_planner(inputs):
    """``reshard_after_forward=None``: with memory to spare every unit keeps its parameters (no second all-gather);
    under a budget between, only the last units (their backward comes first); with the reshard set, none."""
    fixed = choose_blocks_per_unit(inputs, EVERY, 2**40, CPU_RATES)
    assert fixed.kept_units == 0 and fixed.kept_gathered(DEPTH) == frozenset()
    ample = choose_blocks_per_unit(inputs, EVERY, 2**40, CPU_RATES, may_keep=True)
    assert ample.kept_units == ample.units == -(-DEPTH // ample.per_unit)
    assert ample.kept_gathered(DEPTH) == frozenset(range(DEPTH))
    assert ample.saved_seconds > fixed.saved_seconds
    assert f"planner, {ample.units} of {ample.units} units kept gathered for backward" in ample.describe()

    def kept_peak(k: int, m: int) -> int:
        kept = choose_blocks_per_unit(inputs, EVERY, 2**40, CPU_RATES, may_keep=True, per_unit=k)
        resharded = min(DEPTH, k * (kept.units - m))  # the last m units kept
        settings = replace(EVERY, blocks_per_unit=k, kept_gathered=replace(kept, resharded=resharded).kept_gathered())
        return predict_step(inputs, settings).peak

    # Pinned to one block per unit, a budget that holds 4 kept units but not 5: the last four blocks stay gathered
    # (keeping the last few costs no peak here: the step peaks elsewhere).
    between = choose_blocks_per_unit(inputs, EVERY, kept_peak(1, 4), CPU_RATES, may_keep=True, per_unit=1)
    assert kept_peak(1, 4) < kept_peak(1, 5)
    assert (between.per_unit, between.kept_units) == (1, 4) and between.peak <= kept_peak(1, 4)
    assert between.kept_gathered(DEPTH) == frozenset(range(DEPTH - 4, DEPTH))


def test_the_grouping_speaks_autos_encoding(inputs):
    """One encoding of the units kept gathered: the first ``resharded`` blocks reshard, whole units, as in
    ``"auto"``'s :class:`BlockPlan`."""
    between = choose_blocks_per_unit(inputs, EVERY, peak(inputs, 2), CPU_RATES, may_keep=True, per_unit=2)
    assert between.resharded in reshard_boundaries(DEPTH, 2)
    plan = BlockPlan(DEPTH, 0, between.resharded, between.per_unit)
    assert plan.settings(DEPTH).kept_gathered == between.kept_gathered()
    assert between.kept_units == between.units - between.resharded // 2
