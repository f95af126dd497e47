"""``"auto"`` measures the step with no block checkpointed first, and every block's passes under full and selective
checkpointing only where some unit layout does not fit without them (on a step run on real values they are real
compute): the plan is the one the whole measurement gives, at every budget from the recipe's least memory to ample."""

from __future__ import annotations

import pytest
import torch

from lightning_vitscale._utils import human_bytes
from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing
from lightning_vitscale.memory.measurement import Measurement
from lightning_vitscale.memory.plan_search import SearchSpace, fits_unchecked, least_memory
from lightning_vitscale.memory.planner import choose
from lightning_vitscale.memory.planning_batch import EXAMPLE_INPUT, PlanningBatch
from lightning_vitscale.memory.step_cost import rates_for
from lightning_vitscale.memory.step_inputs import OPTIMIZER_STATES, StepSettings
from lightning_vitscale.memory.step_model import predict_step

LONG = dict(image=64, patch=4, dim=96, depth=4)  # 256 tokens: activations dominate
BATCH = 8
SHARDS = 2  # one shard group of two: resharding is a choice too


def planned() -> tuple[TinyViT, PlanningBatch]:
    with torch.device("meta"):
        model = TinyViT(**LONG)
    return model, PlanningBatch(torch.empty(BATCH, 3, 64, 64, device="meta"), EXAMPLE_INPUT)


@pytest.fixture(scope="module")
def whole():
    """The step measured under every checkpointing mode, as before: the oracle's input."""
    model, batch = planned()
    inputs, _ = Measurement(SHARDS, "bf16-mixed")(model, batch)
    assert all(block.modes == {"none", "full", "selective"} for block in inputs.profile.blocks)
    return inputs


def budgets(inputs) -> list[int]:
    """From the recipe's least memory to past everything kept gathered and unchecked, in eight steps."""
    n = len(inputs.profile.blocks)
    low = SearchSpace(inputs, 0, rates_for(None), per_unit=None)
    least = low.peak(least_memory(low))
    most = max(predict_step(inputs, StepSettings(kept_gathered=frozenset(range(n)), blocks_per_unit=k)).peak
               for k in range(1, n + 1))
    return [round(least + (most - least) * i / 6) for i in range(-1, 8)]


@pytest.mark.parametrize("blocks_per_unit", [None, 1])
def test_the_plan_is_the_whole_measurements_at_every_budget(whole, blocks_per_unit):
    model, batch = planned()
    seen = set()
    for budget in budgets(whole):
        auto = AutoCheckpointing(budget, Measurement(SHARDS, "bf16-mixed"), blocks_per_unit=blocks_per_unit)
        choice = auto.choose(model, batch)
        oracle = choose(whole, budget, budget, "bf16-mixed", BATCH, offload=False, rates=rates_for(None),
                        per_unit=blocks_per_unit)
        assert choice.blocks == oracle.blocks, (budget, choice.describe())
        assert choice.plan is not None and choice.plan.fits == oracle.fits
        measured = {frozenset(block.modes) for block in choice.plan.inputs.profile.blocks}
        unchecked = measured == {frozenset({"none"})}
        seen.add(unchecked)
        assert (choice.plan.all_checkpointed is None) == unchecked
        summary = choice.plan.summary()  # what a user reading the auto choice's plan sees
        if unchecked:
            assert "checkpointing was not measured" in choice.describe()
            assert not any(choice.blocks.modes)
            assert "checkpointing not measured: the step fits without it" in summary
            assert "AC on every block" not in summary and "largest batch per rank" not in summary
        else:
            assert choice.plan.all_checkpointed == oracle.all_checkpointed
            assert choice.plan.max_batch == oracle.max_batch
            assert "AC on every block" in summary and "checkpointing not measured" not in summary
    assert seen == {True, False}, "the budgets should span both paths"


def test_fits_unchecked_asks_every_unit_layout_at_its_most_memory(whole):
    """One unit size or one reshard boundary over the budget is enough to measure checkpointing: a plan there may
    need it to fit, and it may be the fastest that fits."""
    n, rates, unchecked = len(whole.profile.blocks), rates_for(None), (None,) * len(whole.profile.blocks)

    def peak(per_unit: int, kept: bool) -> int:
        kept_gathered = frozenset(range(n)) if kept else frozenset()
        return predict_step(whole, StepSettings(kept_gathered=kept_gathered, blocks_per_unit=per_unit)).peak

    top = max(peak(k, kept) for k in range(1, n + 1) for kept in (True, False))
    assert fits_unchecked(SearchSpace(whole, top, rates, per_unit=None, modes=unchecked))
    assert not fits_unchecked(SearchSpace(whole, top - 1, rates, per_unit=None, modes=unchecked))
    # Single blocks resharded take less than kept gathered: a budget between fits only the resharded plans.
    resharded, gathered = peak(1, False), peak(1, True)
    assert resharded < gathered
    assert not fits_unchecked(SearchSpace(whole, resharded, rates, per_unit=1, modes=unchecked))
    assert fits_unchecked(SearchSpace(whole, resharded, rates, fixed_reshard=True, per_unit=1, modes=unchecked))
    # Larger units take more: the size given beside the pinned one is asked too.
    assert peak(2, False) > resharded
    assert not fits_unchecked(SearchSpace(whole, resharded, rates, fixed_reshard=True, per_unit=1, modes=unchecked), 2)


def test_with_offload_on_the_plan_names_the_state_it_keeps_in_host_memory(whole):
    """``offload="cpu"`` on: the plan's note counts the sharded parameters, gradients and optimizer state offloaded.
    It read them from the every-block-full prediction, which has nothing on the device under offload (0 B) and is not
    measured where the step fits unchecked (it raised)."""
    model, batch = planned()
    for budget in (budgets(whole)[0], 2**40):  # checkpointing measured, and not
        auto = AutoCheckpointing(budget, Measurement(SHARDS, "bf16-mixed"), offload=True)
        plan = auto.choose(model, batch).plan
        assert plan is not None and plan.chosen.settings.offload
        shards = predict_step(whole, StepSettings()).params  # this rank's fp32 masters, as the device holds them
        assert shards > 0
        kept = [note for note in plan.notes if note.startswith("offload keeps")]
        assert len(kept) == 1 and human_bytes(shards * (2 + OPTIMIZER_STATES["adamw"])) in kept[0], plan.notes
