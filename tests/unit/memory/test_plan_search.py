"""``activation_checkpointing="auto"``'s search on one process: per block none / selective / full and reshard, the
fastest plan within the budget; the recompute-cost model it ranks plans by; per-block plans applied to a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_vitscale._compat import DTensor
from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory.auto_checkpointing import choose_blocks
from lightning_vitscale.memory.plan_search import BlockPlan, SearchSpace, least_memory, search
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_cost import CPU_RATES, GPU_RATES, recompute_seconds, regather_seconds
from lightning_vitscale.memory.step_model import StepSettings, predict_step
from lightning_vitscale.policies import CheckpointingPolicy, ParallelConfig
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize

WIDE = dict(image=32, patch=4, dim=256, depth=6)  # the 6-block ViT of benchmarks/RESULTS.md's step breakdown
DEPTH = WIDE["depth"]


@pytest.fixture(scope="module")
def inputs():
    with torch.device("meta"):
        planned = TinyViT(**WIDE)
    return step_inputs(planned, torch.empty(8, 3, 32, 32, device="meta"), world_size=2, precision="32-true",
                       device="cpu")


def ends(inputs) -> tuple[int, int]:
    """Peaks of the least-memory plan (every block full and resharded) and of the fastest (none, all gathered)."""
    least = predict_step(inputs, BlockPlan(DEPTH, 0, DEPTH).settings(DEPTH)).peak
    return least, predict_step(inputs, BlockPlan().settings(DEPTH)).peak


def brute_force(space: SearchSpace) -> float:
    """The least predicted extra time of every plan of the search's shape that fits."""
    plans = [BlockPlan(f, s, r) for f in range(DEPTH + 1) for s in range(DEPTH + 1 - f) for r in range(DEPTH + 1)]
    return min(space.seconds(p) for p in plans if space.fits(p))


def test_budgets_force_none_mixed_and_every_block_full(inputs):
    least, most = ends(inputs)
    assert search(SearchSpace(inputs, most, CPU_RATES)) == BlockPlan()  # everything fits: fastest
    assert search(SearchSpace(inputs, least, CPU_RATES)) == BlockPlan(DEPTH, 0, DEPTH)  # only the least fits
    mixed = SearchSpace(inputs, least + (most - least) * 3 // 10, CPU_RATES)  # 3 full + 3 selective, 5 resharded
    plan = search(mixed)
    assert {plan.mode(i) for i in range(DEPTH)} == {"full", "selective"} and 0 < plan.resharded < DEPTH, plan
    assert mixed.fits(plan) and mixed.seconds(plan) == pytest.approx(brute_force(mixed))
    # The user's reshard_after_forward pins it for every block; the search still fits the budget.
    pinned = SearchSpace(inputs, least + (most - least) * 3 // 10, CPU_RATES, fixed_reshard=True)
    assert search(pinned).resharded == DEPTH and pinned.fits(search(pinned))


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95])
def test_search_finds_the_fastest_plan_that_fits(inputs, fraction):
    least, most = ends(inputs)
    for rates in (CPU_RATES, GPU_RATES):  # different ratios of recompute to all-gather cost
        space = SearchSpace(inputs, int(least + (most - least) * fraction), rates)
        plan = search(space)
        assert space.fits(plan) and space.seconds(plan) == pytest.approx(brute_force(space)), (fraction, plan)


def test_infeasible_budget_gives_the_least_memory_plan_and_a_warning(inputs):
    least, _ = ends(inputs)
    space = SearchSpace(inputs, least - 1, CPU_RATES)
    assert search(space) == least_memory(space) == BlockPlan(DEPTH, 0, DEPTH) and not space.fits(search(space))
    with torch.device("meta"):
        planned = TinyViT(**WIDE)
    choice = choose_blocks(planned, torch.empty(8, 3, 32, 32, device="meta"), world_size=2, precision="32-true",
                           budget=least - 1, total=least - 1, device=torch.device("cpu"))
    assert choice.blocks == BlockPlan(DEPTH, 0, DEPTH) and not choice.plan.fits
    assert choice.warning is not None and "no choice fits the memory budget" in choice.warning


def test_recompute_cost_is_the_forward_for_full_and_the_cheap_ops_for_selective(inputs):
    block = inputs.profile.blocks[0]
    real = TinyViT(**WIDE).blocks[0]
    with FlopCounterMode(display=False) as counter:
        real(torch.randn(8, 64, 256))
    assert block.work.flops == counter.get_total_flops() > 0  # torch's own count of the block's forward
    # Norms, GELU, residual adds: at least the block's input and output once each, in fp32.
    assert block.work.cheap_bytes >= 2 * 8 * 64 * 256 * 4
    none, selective, full = (recompute_seconds(block, mode, CPU_RATES) for mode in (None, "selective", "full"))
    assert none == 0 < selective < full
    assert full - selective == pytest.approx(block.work.flops / CPU_RATES.flops_per_s)
    assert recompute_seconds(block, "full", CPU_RATES, scale=2.0) == pytest.approx(2 * full)
    assert regather_seconds(10**6, 1, CPU_RATES) == CPU_RATES.latency_s < regather_seconds(10**6, 2, CPU_RATES)


def test_per_block_kept_gathered_is_between_the_two_global_settings(inputs):
    every = frozenset(range(DEPTH))
    assert predict_step(inputs, StepSettings(kept_gathered=every)) == predict_step(
        inputs, StepSettings(reshard_after_forward=False))
    some, none = (predict_step(inputs, StepSettings(kept_gathered=frozenset(range(k, DEPTH)))).peak for k in (3, 6))
    assert none < some < predict_step(inputs, StepSettings(kept_gathered=every)).peak


def test_a_mixed_plan_is_applied_block_by_block_and_computes_the_same_gradients(mesh):
    """What the strategy does with the choice at setup: each block checkpointed in its mode, the later blocks kept
    gathered for backward; gradients equal an unplanned model's."""
    from lightning_vitscale.sharding.setup import _auto_checkpointing, apply_auto_choice

    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    grads, gathered = [], []
    for planned in (True, False):
        torch.manual_seed(0)
        model = TinyViT(**WIDE)
        model.example_input_array = x
        least, most = ends(step_inputs(model, x, world_size=1, precision="32-true", device="cpu"))
        budget = (least + most) // 2 if planned else 4 * 2**30
        asked = ParallelConfig(checkpointing=CheckpointingPolicy(blocks="auto", memory_budget=budget))
        ranks = SimpleNamespace(mesh=mesh, device=torch.device("cpu"), ranks_per_node=1, agree_max=lambda n: n)
        auto, config = _auto_checkpointing(model, asked, resolve_flag("32-true"), ranks)  # as setup decides
        root = OuterUnit(model)
        done = parallelize(root, model, mesh, config, resolve_flag("32-true"), torch.device("cpu"))
        apply_auto_choice(model, auto, done.plan)
        loss = F.cross_entropy(root(x), y)
        gathered.append([not isinstance(block.qkv.weight, DTensor) for block in model.blocks])
        loss.backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        assert auto is not None and auto.choice is not None
        plan = auto.choice.blocks
        assert [checkpoint_mode(b) for b in model.blocks] == [plan.mode(i) for i in range(DEPTH)]
        assert gathered[-1] == [i >= plan.resharded for i in range(DEPTH)]
        assert f"auto: {plan.describe(DEPTH)}" in done.plan.summary()
        if planned:
            assert {plan.mode(i) for i in range(DEPTH)} != {None}, plan
    for planned_grad, plain_grad in zip(*grads):
        torch.testing.assert_close(planned_grad, plain_grad, rtol=1e-5, atol=1e-6)
