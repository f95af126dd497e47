"""``blocks_per_unit=None`` with the user's checkpointing: the planner's grouping, on one process (fake tensors)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_vitscale.cli.demo import TinyViT
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


def test_fewer_units_where_memory_allows_on_a_cpu_rank(inputs):
    """FSDP's per-unit cost (8 ms a unit on a CPU rank) against the memory of larger units: all 6 blocks in one
    unit when the budget allows, the largest that fits below that, one block per unit when nothing larger fits."""
    ample = choose_blocks_per_unit(inputs, EVERY, 2**40, CPU_RATES)
    # 5 units fewer: their fixed cost and the fixed part of their second all-gather (blocks reshard).
    assert ample.per_unit == DEPTH
    assert ample.saved_seconds == pytest.approx((DEPTH - 1) * (CPU_RATES.unit_s + CPU_RATES.latency_s))
    assert "planner: predicted 50.0 ms per step less than one block per unit" in ample.describe()
    assert peak(inputs, 1) < peak(inputs, 2) < peak(inputs, 3) < peak(inputs, DEPTH)
    assert choose_blocks_per_unit(inputs, EVERY, peak(inputs, 3), CPU_RATES).per_unit == 3
    tight = choose_blocks_per_unit(inputs, EVERY, peak(inputs, 2) - 1, CPU_RATES)
    assert tight.per_unit == 1 and tight.saved_seconds == 0 and "no larger unit fits" in tight.describe()


def test_where_collectives_overlap_compute_a_large_unit_exposes_its_all_gather(inputs):
    """On a GPU (streams) a unit's fixed cost is small and the first unit's all-gather has nothing to hide
    behind: the choice weighs both (the seconds it ranks by are checked against the formula)."""
    for k in (1, 2, 3, DEPTH):
        settings = replace(EVERY, blocks_per_unit=k)
        block = sum(torch.Size(s).numel() for s in inputs.layout.blocks[0]) * 4
        units = -(-DEPTH // k)
        exposed = 2 * k * block * (2 - 1) / 2 / GPU_RATES.link_bytes_per_s
        regather = units * (GPU_RATES.latency_s + k * block / 2 / GPU_RATES.link_bytes_per_s)
        expected = units * GPU_RATES.unit_s + exposed + regather
        assert units_and_regather_seconds(inputs, settings, GPU_RATES) == pytest.approx(expected)
    choice = choose_blocks_per_unit(inputs, EVERY, 2**40, GPU_RATES)
    seconds = {k: units_and_regather_seconds(inputs, replace(EVERY, blocks_per_unit=k), GPU_RATES)
               for k in (1, 2, 3, DEPTH)}
    assert choice.per_unit == min(seconds, key=seconds.get)
