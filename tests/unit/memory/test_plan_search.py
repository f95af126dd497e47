"""The planner's one search on one process: per block none / selective / full and reshard, the blocks per unit, the
fastest plan within the budget, each dimension chosen or pinned (``"auto"``, the default's grouping under the
user's checkpointing); the cost model it ranks plans by; per-block plans applied to a model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.discovery.unit_runs import sharing_keys, spans_of
from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing, AutoChoice
from lightning_vitscale.memory.collectives import ring_bytes
from lightning_vitscale.memory.measurement import Measurement
from lightning_vitscale.memory.plan_search import (
    BlockPlan,
    SearchSpace,
    least_memory,
    reshard_boundaries,
    search,
    unit_sizes,
)
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_cost import (
    GPU_RATES,
    rates_for,
    recompute_seconds,
    regather_seconds,
    units_and_regather_seconds,
)
from lightning_vitscale.memory.step_inputs import StepSettings
from lightning_vitscale.memory.step_model import predict_step, step_phases
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig
from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from tests.helpers.torch_features import needs_policy_outputs

CPU_RATES = rates_for("cpu")  # one rank of the 2-core CPU with gloo (the table's "cpu" row)
WIDE = dict(image=32, patch=4, dim=256, depth=6)  # the 6-block ViT of benchmarks/RESULTS.md's step breakdown
DEPTH = WIDE["depth"]
RECIPE = BlockPlan.prefix(DEPTH, DEPTH, 0, DEPTH)  # every block full, resharded, one per unit: the least memory
NOTHING = BlockPlan.prefix(DEPTH, 0)  # nothing checkpointed, every block kept gathered
EVERY_FULL = ("full",) * DEPTH  # the user's activation_checkpointing=True, pinned


@pytest.fixture(scope="module")
def inputs():
    with torch.device("meta"):
        planned = TinyViT(**WIDE)
    return step_inputs(planned, torch.empty(8, 3, 32, 32, device="meta"), world_size=2, precision="32-true",
                       device="cpu")


def ends(inputs) -> tuple[int, int]:
    """Peaks of the least-memory plan (every block full and resharded) and of the fastest (none, all gathered)."""
    least = predict_step(inputs, RECIPE.settings()).peak
    return least, predict_step(inputs, NOTHING.settings()).peak


def brute_force(space: SearchSpace) -> float:
    """The least predicted extra time of every plan of the search's shape that fits."""
    plans = [BlockPlan.prefix(DEPTH, f, s, r) for f in range(DEPTH + 1) for s in range(DEPTH + 1 - f)
             for r in range(DEPTH + 1)]
    return min(space.seconds(p) for p in plans if space.fits(p))


def test_budgets_force_none_mixed_and_every_block_full(inputs):
    least, most = ends(inputs)
    assert search(SearchSpace(inputs, most, CPU_RATES)) == NOTHING  # everything fits: fastest
    tightest = SearchSpace(inputs, least, CPU_RATES)  # the least plan fits, and those that peak no higher
    tight = search(tightest)
    assert tightest.fits(tight) and tightest.seconds(tight) == pytest.approx(brute_force(tightest))
    assert search(SearchSpace(inputs, least - 1, CPU_RATES)) == RECIPE  # nothing fits
    mixed = SearchSpace(inputs, least + (most - least) * 3 // 10, CPU_RATES)  # 4 full + 2 selective
    plan = search(mixed)
    assert set(plan.modes) == {"full", "selective"}, plan
    assert mixed.fits(plan) and mixed.seconds(plan) == pytest.approx(brute_force(mixed))
    resharding = SearchSpace(inputs, least + (most - least) // 10, CPU_RATES)  # 5 full, 2 resharded
    plan = search(resharding)
    assert 0 < plan.resharded < DEPTH and resharding.seconds(plan) == pytest.approx(brute_force(resharding)), plan
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
    assert search(space) == least_memory(space) == RECIPE and not space.fits(search(space))
    with torch.device("meta"):
        planned = TinyViT(**WIDE)
    auto = AutoCheckpointing(least - 1, Measurement(2, "32-true"), blocks_per_unit=1)
    choice = auto.choose(planned, torch.empty(8, 3, 32, 32, device="meta"), torch.device("cpu"))
    assert choice.blocks == RECIPE and not choice.plan.fits
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
    # A full recompute reruns what backward needs (torch's early stop: not the MLP's last matmul), counted as it runs.
    repeated = block.work.repeated
    assert 0 < repeated.flops < block.work.flops and repeated.cheap_bytes > 0
    assert full == pytest.approx(repeated.flops / CPU_RATES.flops_per_s + repeated.cheap_bytes / CPU_RATES.bytes_per_s)
    assert recompute_seconds(block, "full", CPU_RATES, scale=2.0) == pytest.approx(2 * full)
    # On CPU ranks the second gather's bytes count (gloo's threads share the cores); on a GPU they hide.
    one, two = ring_bytes(10**6, 1), ring_bytes(10**6, 2)
    assert regather_seconds(one, CPU_RATES) == CPU_RATES.latency_s < regather_seconds(two, CPU_RATES)
    assert regather_seconds(two, GPU_RATES) == GPU_RATES.latency_s


def test_per_block_kept_gathered_is_between_the_two_global_settings(inputs):
    every = frozenset(range(DEPTH))
    assert predict_step(inputs, StepSettings(kept_gathered=every)) == predict_step(
        inputs, StepSettings(reshard_after_forward=False))
    some, none = (predict_step(inputs, StepSettings(kept_gathered=frozenset(range(k, DEPTH)))).peak for k in (3, 6))
    assert none < some < predict_step(inputs, StepSettings(kept_gathered=every)).peak


def test_a_mixed_plan_is_applied_block_by_block_and_computes_the_same_gradients(mesh):
    """What the strategy does with the choice at setup: each block checkpointed in its mode, the later blocks kept
    gathered for backward; gradients equal an unplanned model's."""
    from lightning_vitscale.distributed import RankContext
    from lightning_vitscale.sharding import resolve_config
    from lightning_vitscale.sharding.planning import apply_auto_choice, plan_before_sharding

    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    grads, gathered = [], []
    for planned in (True, False):
        torch.manual_seed(0)
        model = TinyViT(**WIDE)
        model.example_input_array = x
        least, most = ends(step_inputs(model, x, world_size=1, precision="32-true", device="cpu"))
        budget = (least + most) // 2 if planned else 4 * 2**30
        asked = ParallelConfig(checkpointing=CheckpointingPolicy(blocks="auto", memory_budget=budget))
        ranks = RankContext(mesh=mesh, device=torch.device("cpu"))
        resolved = resolve_config(asked, torch.device("cpu"))
        before = plan_before_sharding(model, resolved, resolve_flag("32-true"), ranks, budget)  # as setup does
        auto, config = before.auto, before.resolved
        root = OuterUnit(model)
        done = parallelize(root, model, mesh, config, resolve_flag("32-true"), torch.device("cpu"))
        apply_auto_choice(model, auto, done.plan)
        loss = F.cross_entropy(root(x), y)
        gathered.append([not isinstance(block.qkv.weight, DTensor) for block in model.blocks])
        loss.backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        assert auto is not None and auto.choice is not None
        plan = auto.choice.blocks
        assert [checkpoint_mode(b) for b in model.blocks] == list(plan.modes)
        assert gathered[-1] == [i >= plan.resharded for i in range(DEPTH)]
        assert f"auto: {plan.describe()}" in done.plan.summary()
        # example_input_array: the planner chose the blocks per unit at setup, and those are the units built.
        assert plan.per_unit > 1 and done.plan.blocks_per_unit == plan.per_unit, plan
        assert done.plan.units == -(-DEPTH // plan.per_unit) + 1
        if planned:
            assert set(plan.modes) != {None}, plan
    for planned_grad, plain_grad in zip(*grads):
        torch.testing.assert_close(planned_grad, plain_grad, rtol=1e-5, atol=1e-6)


def grouped(items: list, per_unit: int, unit_of=None, sharing=None) -> list[list]:
    """``items`` in the units ``spans_of`` makes of them, as setup groups its blocks."""
    return [[items[i] for i in span] for span in spans_of(len(items), per_unit, unit_of, sharing)]


def test_plain_units_are_runs_of_blocks_per_unit_and_the_sizes_tried_cover_every_number_of_units():
    for n in (1, 5, 6, 12):
        for k in range(1, n + 1):
            assert grouped(list(range(n)), k) == [list(range(s, min(s + k, n))) for s in range(0, n, k)]
    # Up to every block in one unit: the smallest size for each number of units.
    assert unit_sizes(12, None) == [1, 2, 3, 4, 6, 12] and unit_sizes(6, None) == [1, 2, 3, 6]
    assert unit_sizes(32, None) == [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 32]
    assert unit_sizes(12, 5) == [5] and unit_sizes(0, None) == [1]


def test_a_unit_gathers_its_blocks_together_and_holds_their_gradients_until_its_reduce_scatter(inputs):
    """Three blocks per unit against one: in forward, the largest unit and its all-gather buffer (2 x 3 blocks
    instead of 2 x 1 while blocks reshard); in the backward of a unit's first block, the unsharded gradients of
    the unit's two later blocks are still waiting for the unit's one reduce-scatter."""
    block = sum(torch.Size(s).numel() for s in inputs.layout.blocks[0]) * 4  # fp32
    one, three = ({b.phase: b for b in step_phases(inputs, StepSettings(blocks_per_unit=k))} for k in (1, 3))
    gather = "all-gather of unit 1"  # blocks 3-5 with 3 per unit, block 1 with one: the earlier unit(s) resharded
    assert three[gather].gathered - one[gather].gathered == (3 - 1) * block
    assert three[gather].transient - one[gather].transient == (3 - 1) * block  # all-gather output / gloo's copy
    first, last = "backward of block 3", "backward of block 5"
    assert three[first].transient - three[last].transient == 2 * block  # blocks 4 and 5's gradients unsharded
    assert three[last].transient == one[last].transient  # a unit's last block: its own gradients only
    # On CPU the later unit's reduce-scatter is in flight through a unit's backward (its input and gloo's copy):
    # block 4's with one per unit; none for the last unit's blocks.
    assert one[first].transient - one[last].transient == 2 * block
    # One reduce-scatter for the unit: 3 blocks' gradients (FSDP's input and gloo's copy of it), new shards.
    assert three["reduce-scatter of unit 1"].transient - one["reduce-scatter of unit 5"].transient == 2 * 2 * block
    assert "reduce-scatter of unit 5" not in three
    # A fully checkpointed, resharded block recomputes while FSDP still holds the later unit's reduce-scatter
    # input: 3 blocks' worth with 3 per unit, 1 with one (block 2 is its unit's last: nothing else pending).
    every = frozenset(range(DEPTH))
    one, three = ({b.phase: b for b in step_phases(inputs, StepSettings(every, blocks_per_unit=k))} for k in (1, 3))
    assert three["backward of block 2"].transient - one["backward of block 2"].transient == 2 * block
    # Sharded gradients exist only for units whose reduce-scatter is done: none after the last unit.
    assert three[first].grads == three[last].grads == 0 < one[first].grads
    assert predict_step(inputs, StepSettings(blocks_per_unit=3)).peak > predict_step(inputs, StepSettings()).peak


@pytest.mark.parametrize("fraction", [0.2, 0.6, 1.0, 1.5])
def test_the_search_chooses_blocks_per_unit_exactly_when_free(inputs, fraction):
    """``per_unit=None`` (the batch known at setup): the fastest plan over every candidate unit size that fits,
    with the per-unit cost counted; never slower than one block per unit; pinned sizes stay pinned."""
    least, most = ends(inputs)
    budget = int(least + (most - least) * fraction)
    free = SearchSpace(inputs, budget, CPU_RATES, per_unit=None)
    plan = search(free)
    plans = [BlockPlan.prefix(DEPTH, f, s, r, k) for k in unit_sizes(DEPTH, None) for f in range(DEPTH + 1)
             for s in range(DEPTH + 1 - f) for r in range(DEPTH + 1)]
    assert free.fits(plan) and free.seconds(plan) == pytest.approx(min(free.seconds(p) for p in plans if free.fits(p)))
    pinned = search(SearchSpace(inputs, budget, CPU_RATES))
    assert pinned.per_unit == 1 and free.seconds(plan) <= free.seconds(pinned)
    if fraction >= 1.0:  # room to spare: fewer units beat more on a CPU rank (8 ms each)
        assert plan.per_unit > 1, plan
    assert search(SearchSpace(inputs, budget, CPU_RATES, per_unit=2)).per_unit == 2


def test_kept_blocks_are_whole_units():
    """A plan whose resharded blocks end inside a unit: that unit reshards (FSDP's reshard is a unit's setting),
    and only whole units after it stay gathered."""
    names = [f"blocks.{i}" for i in range(6)]
    choice = AutoChoice(plan=None, block_names=names, blocks=BlockPlan.prefix(6, 0, resharded=4, per_unit=3))
    assert choice.kept_gathered == []
    choice = AutoChoice(plan=None, block_names=names, blocks=BlockPlan.prefix(6, 0, resharded=3, per_unit=3))
    assert choice.kept_gathered == names[3:]


def test_units_chosen_only_at_the_first_step_are_named_as_a_hint(inputs):
    """Without example_input_array the units exist before the batch is known: the plan keeps one block per unit
    and says what the planner's own grouping would have saved, and how to get it."""
    _, most = ends(inputs)
    with torch.device("meta"):
        planned = TinyViT(**WIDE)
    auto = AutoCheckpointing(4 * most, Measurement(2, "32-true"))  # the units left to it, but made before the batch:
    auto.blocks_per_unit = 1
    choice = auto.choose(planned, torch.empty(8, 3, 32, 32, device="meta"), torch.device("cpu"))
    assert choice.blocks.per_unit == 1 and choice.hint is not None
    # 6 blocks on CPU ranks (overlapped collectives): 3 units of 2 beat 6 units' fixed cost and 1 unit's exposed bytes
    assert "example_input_array" in choice.hint and "blocks_per_unit=2" in choice.hint


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
def test_the_plan_fits_wherever_the_recipes_plan_fits(inputs, fraction):
    """The recipe's plan (every block full, its own unit, resharded) is in every space left free, and in the space
    of the user's checkpointing pinned to it: from the recipe's own peak up, the plan chosen fits.
    Mutation tried: ``least_memory`` with two blocks per unit (the recipe outside the space) fails at 0.0."""
    least, most = ends(inputs)
    budget = int(least + (most - least) * fraction)
    for space in (SearchSpace(inputs, budget, CPU_RATES, per_unit=None),
                  SearchSpace(inputs, budget, GPU_RATES, per_unit=None, modes=EVERY_FULL)):
        assert least_memory(space) == RECIPE
        assert space.fits(search(space)), (fraction, search(space))


def test_the_users_checkpointing_is_a_pinned_dimension_of_the_one_search(inputs):
    """``activation_checkpointing=True`` with the units left to the planner: where nothing overlaps the step's
    collectives a unit's fixed cost is all there is, so every block in one unit when the budget allows it, the
    largest that fits below that, one block per unit when nothing larger fits; the modes stay the user's."""
    serial = replace(CPU_RATES, overlaps=False)

    def plan(budget: int, rates=serial, **pinned) -> tuple[SearchSpace, BlockPlan]:
        space = SearchSpace(inputs, budget, rates, fixed_reshard=pinned.pop("reshard", True),
                            per_unit=pinned.pop("per_unit", None), modes=EVERY_FULL)
        return space, search(space)

    def peak(k: int) -> int:
        return predict_step(inputs, replace(RECIPE, per_unit=k).settings()).peak

    space, ample = plan(2**40)
    assert ample.modes == EVERY_FULL and ample.per_unit == DEPTH
    # 5 units fewer: their fixed cost and the fixed part of their second all-gather (blocks reshard); the bytes
    # gathered again are the same whatever the grouping.
    saved = space.seconds(least_memory(space)) - space.seconds(ample)
    assert saved == pytest.approx((DEPTH - 1) * (serial.unit_s + serial.latency_s))
    assert peak(1) < peak(2) < peak(3) < peak(DEPTH)
    assert plan(peak(3))[1].per_unit == 3
    assert plan(peak(2) - 1)[1] == RECIPE
    # Where collectives overlap compute (GPU streams, CPU ranks' asynchronous gloo), a large unit exposes its
    # all-gather and reduce-scatter: the choice is the formula's best, on the 2-core CPU neither extreme.
    for rates in (GPU_RATES, CPU_RATES):
        block = sum(torch.Size(s).numel() for s in inputs.layout.blocks[0]) * 4
        seconds = {}
        for k in unit_sizes(DEPTH, None):
            units, exposed = -(-DEPTH // k), 2 * k * block * (2 - 1) / 2 / rates.link_bytes_per_s
            regather = 0.0 if rates.regather_hidden else units * k * block / 2 / rates.link_bytes_per_s
            seconds[k] = units * (rates.unit_s + rates.latency_s) + exposed + regather
            settings = replace(RECIPE, per_unit=k).settings()
            assert units_and_regather_seconds(inputs, settings, rates) == pytest.approx(seconds[k])
        assert plan(2**40, rates)[1].per_unit == min(seconds, key=seconds.get)
    assert min(seconds, key=seconds.get) == 2  # CPU_RATES: measured best on the 2-core CPU (RESULTS.md)


def test_units_stay_gathered_for_backward_where_memory_allows_under_the_users_checkpointing(inputs):
    """``reshard_after_forward=None``: with memory to spare every unit keeps its parameters (no second all-gather);
    under a budget between, only the last units (their backward comes first), whole units; pinned, none."""
    def plan(budget: int, reshard: bool | None, per_unit: int | None = None) -> BlockPlan:
        return search(SearchSpace(inputs, budget, CPU_RATES, fixed_reshard=reshard, per_unit=per_unit,
                                  modes=EVERY_FULL))

    fixed, ample = plan(2**40, True), plan(2**40, None)
    assert fixed.kept_units == 0 and ample.kept_units == ample.units == -(-DEPTH // ample.per_unit)
    space = SearchSpace(inputs, 2**40, CPU_RATES, per_unit=None, modes=EVERY_FULL)
    assert space.seconds(ample) < space.seconds(fixed)
    assert ample.settings().kept_gathered == frozenset(range(DEPTH))

    def kept_peak(m: int) -> int:  # one block per unit, the last m kept
        return predict_step(inputs, BlockPlan(EVERY_FULL, DEPTH - m).settings()).peak

    # Pinned to one block per unit, a budget that holds 4 kept units but not 5: the last four blocks stay gathered.
    assert kept_peak(4) < kept_peak(5)
    between = plan(kept_peak(4), None, per_unit=1)
    assert (between.per_unit, between.kept_units, between.resharded) == (1, 4, DEPTH - 4)
    two = plan(kept_peak(4), None, per_unit=2)
    boundaries = reshard_boundaries(spans_of(DEPTH, 2), DEPTH)
    assert two.resharded in boundaries and boundaries == [DEPTH, *range(DEPTH - 2, -1, -2)]  # whole units only


class _InplaceAfterConv(torch.nn.Module):
    """torchvision's squeeze-excitation pattern: an inplace activation on a convolution's output, which selective
    checkpointing keeps ("Tensor cached during selective activation checkpoint has been mutated")."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 1)
        self.act = torch.nn.SiLU(inplace=True)

    def forward(self, x):
        return x + self.act(self.conv(x))


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 1.0])
def test_blocks_that_cannot_run_selectively_get_none_or_full_the_fastest_that_fits(inputs, fraction):
    """EfficientNet's blocks: measured without ``selective`` (their step fails under it), the search keeps to none
    and full; the speed-first plan had given up and checkpointed every block."""
    from lightning_vitscale.memory.activations import measure_activations
    from lightning_vitscale.memory.selective_ops import SelectiveCheckpointingError

    blocks = [_InplaceAfterConv() for _ in range(2)]
    measured = measure_activations(torch.nn.Sequential(*blocks), [(str(i), b) for i, b in enumerate(blocks)],
                                   torch.empty(2, 4, 8, 8))
    assert [b.modes for b in measured.blocks] == [frozenset({"none", "full"})] * 2
    with pytest.raises(SelectiveCheckpointingError, match="0 cannot be checkpointed selectively.*'full'"):
        measure_activations(torch.nn.Sequential(*blocks), [(str(i), b) for i, b in enumerate(blocks)],
                            torch.empty(2, 4, 8, 6), mode_of=lambda *_: "selective")
    no_selective = replace(inputs, profile=replace(inputs.profile, blocks=[
        replace(b, modes=frozenset({"none", "full"})) for b in inputs.profile.blocks]))
    least, most = ends(inputs)
    space = SearchSpace(no_selective, int(least + (most - least) * fraction), CPU_RATES)
    plan = search(space)
    plans = [BlockPlan.prefix(DEPTH, f, 0, r) for f in range(DEPTH + 1) for r in range(DEPTH + 1)]
    assert "selective" not in plan.modes and space.fits(plan)
    assert space.seconds(plan) == pytest.approx(min(space.seconds(p) for p in plans if space.fits(p)))


class _RelativePositionsInPlace(torch.nn.Module):
    """timm MViTv2's attention: relative positions added in place into the scores ``q @ k^T``, a 4-D matmul whose
    ``bmm`` output comes back through ``_unsafe_view`` (a version counter of its own: torch's check of the kept
    tensor does not see the write)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(8, 16)
        self.rel = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        q, k = self.qk(x).reshape(2, 2, 4, 4, 2).unbind(-1)  # (batch, heads, tokens, dim) twice
        attn = q @ k.transpose(-2, -1)
        attn[:, :, 1:, 1:] = attn[:, :, 1:, 1:] + self.rel[1:, 1:]
        return x + (attn.softmax(-1) @ q).transpose(1, 2).reshape(2, 4, 8)


@needs_policy_outputs
def test_a_block_writing_in_place_into_a_kept_matmul_output_is_refused_selective_checkpointing():
    """Selectively checkpointed, the block's recompute ran on the kept scores that already held the relative
    positions and added them again: gradients silently wrong (timm MViTv2: its losses left DDP's from the second
    step). The policy refuses the write, so the planner measures the block without ``selective`` (as the
    in-place activation above) and a run asking for it fails at setup, never with other gradients.
    Mutation seen failing: the write check removed (the gradients differ, the block is measured selective)."""
    from lightning_vitscale.memory.activations import measure_activations
    from lightning_vitscale.memory.selective_ops import selective_contexts

    torch.manual_seed(0)
    block, x = _RelativePositionsInPlace(), torch.randn(2, 4, 8)
    block(x).pow(2).sum().backward()
    expected = block.rel.grad.clone()
    block.zero_grad()
    try:
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=selective_contexts)
        out.pow(2).sum().backward()
        raised = None
    except RuntimeError as error:
        raised = str(error)
    assert raised is not None and "writes in place into the output of a matmul" in raised, block.rel.grad
    assert expected.abs().sum() > 0
    measured = measure_activations(torch.nn.Sequential(block), [("0", block)], x)
    assert measured.blocks[0].modes == frozenset({"none", "full"})


@needs_policy_outputs
def test_asking_selective_for_such_a_block_fails_at_setup_through_trainer_fit():
    """The user's path: ``activation_checkpointing="selective"`` on that block stops at setup, naming the block and
    the fix, before any step could train on other gradients."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_vitscale import VitScaleStrategy
    from lightning_vitscale.memory.selective_ops import SelectiveCheckpointingError

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([_RelativePositionsInPlace(), _RelativePositionsInPlace()])

        def training_step(self, batch, batch_idx):
            x = batch[0]
            for block in self.blocks:
                x = block(x)
            return x.pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(4, 4, 8)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=VitScaleStrategy(activation_checkpointing="selective"))
    with pytest.raises(SelectiveCheckpointingError, match=r"blocks.0 cannot be checkpointed selectively.*'full'"):
        trainer.fit(Module(), data)
    assert trainer.global_step == 0


def test_blocks_join_a_unit_only_where_the_measured_step_runs_them_as_one_stretch():
    """``sharing_keys``: without a measured step a unit never spans two containers (the step may run them apart);
    with one, two neighbours share a unit only where the step always ran them back to back (HF Mask2Former's last
    pixel-decoder projection ran once, its mask MLP once per decoder layer: one unit of the two failed on resharded
    weights); a backbone run twice in a step (DINO's crops) and two towers one after the other still group.
    ``spans_of`` starts a unit where the key changes, and still never splits a discovered unit. Mutation seen
    failing: the measured step's order ignored (one key)."""
    names = ["enc.layers.0", "enc.layers.1", "dec.proj.0", "head.mlp.0", "head.mlp.1"]
    units = [(name, [(name, None)]) for name in names]
    unmeasured = sharing_keys(units, measured=False)
    assert unmeasured == ["in enc.layers"] * 2 + ["in dec.proj"] + ["in head.mlp"] * 2
    assert grouped(list("abcde"), 2, sharing=unmeasured) == [["a", "b"], ["c"], ["d", "e"]]
    apart = sharing_keys(units, measured=True, order=[*names[:3], *names[3:] * 3])
    assert grouped(list("abcde"), 4, sharing=apart) == [["a", "b", "c"], ["d", "e"]]
    skipped = sharing_keys(units, measured=True, order=[names[0], *names[2:]])  # LayerDrop skipped one
    assert grouped(list("abcde"), 4, sharing=skipped) == [["a", "b", "c", "d"], ["e"]]
    twice = sharing_keys(units, measured=True, order=names * 2)
    assert grouped(list("abcde"), 4, sharing=twice) == [["a", "b", "c", "d"], ["e"]]
    assert grouped(list("abcde"), 4, sharing=sharing_keys(units, measured=True)) == [["a", "b", "c", "d"], ["e"]]
    assert grouped(list("abcd"), 1, unit_of=[0, 0, 1, 1], sharing=["x", "y", "y", "y"]) == [["a", "b"], ["c", "d"]]
