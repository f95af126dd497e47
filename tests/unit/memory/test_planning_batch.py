"""The batch the planner measures without ``example_input_array``: one batch of the train dataloader, run through
``training_step`` (modules without ``forward`` included), and the one ``memory_budget`` its choices keep to."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_vitscale._utils import GIB, MIB
from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory import describe_prediction, device_memory, twin
from lightning_vitscale.memory.budget import resolve_budget
from lightning_vitscale.memory.planner import batch_size_of, plan_memory, step_inputs
from lightning_vitscale.memory.planning_batch import (
    TRAIN_BATCH,
    PlanningBatch,
    first_batch,
    has_forward,
    measure_batch,
    planning_batch,
)
from lightning_vitscale.memory.step_inputs import StepSettings
from lightning_vitscale.memory.step_model import predict_step
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig, resolve_config

SMALL = dict(image=16, patch=4, dim=32, depth=2)


class NoForward(L.LightningModule):
    """A LightningModule whose ``training_step`` calls its backbone twice (no ``forward`` of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = TinyViT(**SMALL)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y) + F.cross_entropy(self.backbone(x.flip(-1)), y)
        self.log("loss", loss)
        return {"loss": loss}


def data(n: int = 12) -> TensorDataset:
    return TensorDataset(torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,)))


class Stream(IterableDataset):
    def __iter__(self):
        yield from data()


def test_the_first_batch_is_the_loaders_first_samples_collated_without_drawing_random_numbers():
    dataset = data()
    state = torch.get_rng_state()
    x, y = first_batch(DataLoader(dataset, batch_size=4, shuffle=True))
    assert torch.equal(torch.get_rng_state(), state)  # shuffling would have drawn from the global generator
    assert torch.equal(x, dataset.tensors[0][:4]) and torch.equal(y, dataset.tensors[1][:4])
    assert first_batch(DataLoader(dataset, batch_size=None)) is None  # no batch dimension the loader adds
    assert first_batch(DataLoader(Stream(), batch_size=4)) is None  # reading it could consume it
    assert first_batch([dataset[0]]) is None  # not a DataLoader


def test_a_module_without_forward_is_measured_through_training_step():
    model = NoForward()
    assert not has_forward(model) and has_forward(TinyViT(**SMALL))
    batch = PlanningBatch(first_batch(DataLoader(data(), batch_size=4)), TRAIN_BATCH, through_training_step=True)
    inputs, how = measure_batch(model, batch, world_size=1, precision="32-true", device="cpu")
    assert how == "one batch of the train dataloader, through training_step"
    assert [b.name for b in inputs.profile.blocks] == ["backbone.blocks.0", "backbone.blocks.1"]
    # The backbone runs twice per step: its blocks keep twice what one forward keeps.
    once = step_inputs(model.backbone, batch.value[0], world_size=1, precision="32-true", device="cpu")
    assert inputs.profile.blocks[0].saved == 2 * once.profile.blocks[0].saved
    assert not any(isinstance(p, torch.Tensor) and p.is_meta for p in model.parameters())  # the module untouched


class WithMetric(NoForward):
    """Lightning's most common step: a torchmetrics metric updated (and logged) in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.backbone(x)
        self.train_acc(logits, y)
        self.train_acc.update(logits, y)
        self.log("train_acc", self.train_acc)
        return F.cross_entropy(logits, y)


def test_a_training_step_that_updates_a_metric_is_measured_through_training_step():
    model = WithMetric()
    batch = PlanningBatch(first_batch(DataLoader(data(), batch_size=4)), TRAIN_BATCH, through_training_step=True)
    inputs, how = measure_batch(model, batch, world_size=1, precision="32-true", device="cpu")
    assert how == "one batch of the train dataloader, through training_step", how
    once = step_inputs(model.backbone, batch.value[0], world_size=1, precision="32-true", device="cpu")
    assert [dataclasses.replace(b, name="backbone." + b.name) for b in once.profile.blocks] == inputs.profile.blocks
    assert model.train_acc.update_count == 0 and "forward" not in model.train_acc.__dict__  # the real one untouched


class Branching(TinyViT):
    """A ``training_step`` that decides on a value: fake tensors have none (the branch is never taken here)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 0.5 if loss.item() > 100 else loss


class ThroughNumPy(TinyViT):
    """A ``training_step`` that reads its loss through NumPy (as DETR's loss matches boxes with SciPy): fake tensors
    alone have no values to give it."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 0.5 if np.asarray(loss.detach()) > 100 else loss


def test_a_training_step_that_reads_a_value_is_measured_through_it_and_one_that_branches_on_it_on_real_values(
    monkeypatch,
):
    """A branch on a value, or a value read through NumPy: measured through ``training_step`` again, on fake tensors
    carrying real values (the batch whole where it is small); without real values (a model on the meta device, one
    over the size the planner copies) through ``forward``, as before. Each gives the plain model's numbers.
    Mutations seen failing: no real-value run (through forward); ``.numpy()`` of a fake tensor left refused."""
    batch = PlanningBatch(first_batch(DataLoader(data(), batch_size=4)), TRAIN_BATCH, through_training_step=True)
    plain = step_inputs(TinyViT(**SMALL), batch.value[0], world_size=1, precision="32-true", device="cpu")
    # TinyViT's training_step appends loss.item() to a list: a symbolic number on fake tensors, measured as it runs
    step, how = measure_batch(TinyViT(**SMALL), batch, world_size=1, precision="32-true", device="cpu")
    assert how == "one batch of the train dataloader, through training_step", how
    assert step.profile.blocks == plain.profile.blocks
    for model in (Branching(**SMALL), ThroughNumPy(**SMALL)):
        inputs, how = measure_batch(model, batch, world_size=1, precision="32-true", device="cpu")
        assert how == "one batch of the train dataloader, through training_step, with real values", how
        assert inputs.profile == step.profile and inputs.batch_scale == 1
    big = Branching(**SMALL)
    monkeypatch.setattr(twin, "REAL_VALUES_LIMIT", sum(p.numel() * 4 for p in big.parameters()) - 1)
    for model in (big, Branching(**SMALL).to("meta")):
        inputs, how = measure_batch(model, batch, world_size=1, precision="32-true", device="cpu")
        assert how.startswith("one batch of the train dataloader, through forward (training_step could not run"), how
        assert inputs.profile.blocks == plain.profile.blocks


class NoisyImages(NoForward):
    """Noise made in fp32 inside the step, added to the images before the backbone, and a check that the batch comes
    in the dataloader's dtype (as torchvision's detectors check their target boxes)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert x.dtype == torch.float32, x.dtype
        return F.cross_entropy(self.backbone(x + 0.1 * torch.randn(x.shape, device=x.device)).float(), y)


def test_under_bf16_mixed_the_step_is_measured_with_the_batch_as_given_and_each_layer_casting_its_inputs():
    """As the strategy runs it: the batch in its own dtype, each block and each layer outside the blocks casting its
    floating inputs to bf16 (before, the planner cast the batch and nothing else: a tensor the step made in fp32 met
    the bf16 patch embedding and the step fell back, as HF DETR's did). Mutations seen failing: no casts at the
    layers (``Input type (float) and bias type (BFloat16)``), the batch cast (the step's check)."""
    batch = PlanningBatch(first_batch(DataLoader(data(), batch_size=4)), TRAIN_BATCH, through_training_step=True)
    inputs, how = measure_batch(NoisyImages(), batch, world_size=1, precision="bf16-mixed", device="cpu")
    assert how == "one batch of the train dataloader, through training_step"
    assert [b.name for b in inputs.profile.blocks] == ["backbone.blocks.0", "backbone.blocks.1"]
    plain, _ = measure_batch(NoForward(), batch, world_size=1, precision="bf16-mixed", device="cpu")
    assert inputs.profile.blocks[0].saved * 2 == plain.profile.blocks[0].saved  # one backbone pass, not two


class UnmeasurableStep(NoForward):
    """No ``forward``; a branch on the loss (fake tensors alone fail there), then torchvision's ``roi_pool`` on bf16
    features (real values fail there: its host kernel has no bf16 and, unlike ``nms``, no autocast kernel on the host
    to run it in fp32, so it fails under DDP's AMP too)."""

    def training_step(self, batch, batch_idx):
        from torchvision.ops import roi_pool

        loss = super().training_step(batch, batch_idx)["loss"]
        loss = loss * 0.5 if loss.item() > 100 else loss
        features = torch.zeros(1, 2, 4, 4, dtype=torch.bfloat16)  # a model's features under O2 (the loss is fp32)
        boxes = torch.tensor([[0.0, 0.0, 0.0, 2.0, 2.0]], dtype=torch.bfloat16)
        return loss + 0 * roi_pool(features, boxes, 2).sum()


def test_a_step_that_fails_on_real_values_too_says_both_errors():
    """The real run's error is said beside the fake run's, not dropped (the setup summary and the default's fallback
    carry its first line). Mutation seen failing: the real run's error swallowed (the fake run's alone raised).
    torchvision 0.29 raises ``RuntimeError`` for the missing bf16 kernel, 0.26 (the GPU image's)
    ``NotImplementedError``."""
    from lightning_vitscale.memory.real_values import StepNotMeasuredError

    batch = PlanningBatch(first_batch(DataLoader(data(), batch_size=4)), TRAIN_BATCH, through_training_step=True)
    both = r"GuardOnDataDependentSymNode.*; on real values: (RuntimeError|NotImplementedError): .*roi_pool"
    with pytest.raises(StepNotMeasuredError, match=both):
        measure_batch(UnmeasurableStep(), batch, world_size=1, precision="bf16-mixed", device="cpu")


def test_a_larger_batch_runs_two_and_three_samples_on_real_values_and_extrapolates_to_the_batch():
    """Eight samples: the real-value run takes the first two and three and carries each number along their line, which
    for a ViT (activations grow with the samples, weight gradients do not) is the batch's own measurement, exactly;
    scaling one sample's numbers by 8 would over-predict the backward (the gradients counted eight times). Mutation
    seen failing: the batch scaled from three samples (the peak over by the gradients)."""
    loader = DataLoader(data(), batch_size=8)
    batch = planning_batch(Branching(**SMALL), _fitting(loader))
    assert batch is not None and batch.samples == 8
    plain, _ = measure_batch(TinyViT(**SMALL), batch, world_size=1, precision="32-true", device="cpu")
    model = Branching(**SMALL)
    state = torch.get_rng_state()
    inputs, how = measure_batch(model, batch, world_size=1, precision="32-true", device="cpu")
    assert torch.equal(torch.get_rng_state(), state)  # the real run drew its random numbers from a fork
    assert how.endswith("with real values on its first 2 and 3 samples, extrapolated to 8"), how
    assert inputs.profile == plain.profile and inputs.batch_scale == 1
    every = StepSettings(frozenset({0, 1}))
    assert predict_step(inputs, every).peak == predict_step(plain, every).peak


@pytest.mark.parametrize("samples", [4, 5])
def test_a_batch_of_at_most_five_runs_whole_on_real_values_once(samples, monkeypatch):
    """Up to five samples the batch runs whole, once: its first two and three would cost as many samples or more, in
    two runs (a Faster R-CNN's setup at batch 4: 23 s of planning with two runs, 10 s with one), and the measurement
    is the batch's own. Mutation seen failing: the limit back at 3 (two runs, extrapolated)."""
    from lightning_vitscale.memory import real_values

    runs: list[int] = []
    measured = real_values.step_inputs

    def counted(twin, batch, **kwargs):
        runs.append(batch_size_of(batch))
        return measured(twin, batch, **kwargs)

    monkeypatch.setattr(real_values, "step_inputs", counted)
    batch = planning_batch(Branching(**SMALL), _fitting(DataLoader(data(), batch_size=samples)))
    assert batch is not None and batch.samples == samples
    plain, _ = measure_batch(TinyViT(**SMALL), batch, world_size=1, precision="32-true", device="cpu")
    inputs, how = measure_batch(Branching(**SMALL), batch, world_size=1, precision="32-true", device="cpu")
    assert how.endswith("with real values"), how
    assert runs == [samples]
    assert inputs.profile == plain.profile and inputs.batch_scale == 1


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.conv(x))


class Heatmap(L.LightningModule):
    """A CenterNet-style loss, as examples/detection.py's: a target heatmap written at each label's channel (an index
    taken from a value: on fake tensors alone a SymInt, which indexing refuses with an IndexError) of a GroupNorm's
    output on channels-last activations (CPU's kernel keeps the layout, the fake one does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock() for _ in range(2))
        self.stats = nn.BatchNorm2d(8)
        self.norm = nn.GroupNorm(2, 8)

    def training_step(self, batch, batch_idx):
        x, labels = batch
        x = self.stats(x.contiguous(memory_format=torch.channels_last))
        for block in self.blocks:
            x = block(x)
        heat = self.norm(x)
        target = torch.zeros_like(heat)
        for i, c in enumerate(labels.tolist()):
            target[i, c] = torch.maximum(target[i, c], heat[i, c].detach().sigmoid())
        return F.mse_loss(heat.sigmoid(), target)


def test_an_index_taken_from_a_value_on_a_channels_last_activation_runs_on_real_values():
    """Any error of the fake run is tried again on real values (here an IndexError, not a data-dependent guard), and
    a real result is laid out as its fake one, so that a view of it sits at the fake view's offset. Mutation seen
    failing: the real results left in CPU's layout (torch's real-value check refuses ``target[i, c]``'s offset, and
    the fake run's IndexError is raised)."""
    data = TensorDataset(torch.randn(8, 8, 6, 6), torch.randint(0, 8, (8,)))
    batch = PlanningBatch(first_batch(DataLoader(data, batch_size=4)), TRAIN_BATCH, through_training_step=True)
    model = Heatmap()
    inputs, how = measure_batch(model, batch, world_size=1, precision="32-true", device="cpu")
    assert how == "one batch of the train dataloader, through training_step, with real values", how
    assert not model.stats.running_mean.any() and model.stats.num_batches_tracked == 0  # ran on copies
    assert [block.name for block in inputs.profile.blocks] == ["blocks.0", "blocks.1"]
    assert all(block.saved > 0 for block in inputs.profile.blocks)


def test_extrapolation_keeps_what_does_not_grow_and_refuses_unlike_measurements():
    from lightning_vitscale.memory.fake_modes import UnlikeRecords
    from lightning_vitscale.memory.real_values import extrapolated

    two = dict(saved=[200, 10], calls=3, share=1.5, name="blocks.0")
    three = dict(saved=[300, 10], calls=3, share=1.5, name="blocks.0")
    assert extrapolated(two, three, 5) == dict(saved=[800, 10], calls=3, share=1.5, name="blocks.0")
    assert extrapolated(dict(free=30), dict(free=20), 5) == dict(free=0)  # never below nothing
    for unlike in (dict(three, saved=[300]), dict(three, name="blocks.1"), dict(three, share=None)):
        with pytest.raises(UnlikeRecords):
            extrapolated(two, unlike, 5)


def _fitting(loader: DataLoader) -> SimpleNamespace:
    """What ``planning_batch`` reads of a Trainer while fitting: its train dataloader."""
    return SimpleNamespace(fit_loop=SimpleNamespace(_data_source=SimpleNamespace(
        is_defined=lambda: True, dataloader=lambda: loader)))


def test_the_planners_units_keep_to_memory_budget_without_auto(mesh, monkeypatch):
    """``blocks_per_unit=None`` with the checkpointing the user chose: a budget below any grouping's peak leaves one
    block per unit, nothing kept gathered; the default budget lets the planner group. The budget is resolved once,
    in bytes (one rank: its own). The host's free memory is pinned: read twice, it moved with other processes."""
    from lightning_vitscale.distributed import RankContext
    from lightning_vitscale.sharding import planning
    from lightning_vitscale.sharding.planning import agreed_budget, plan_before_sharding

    host = device_memory(torch.device("cpu"), 1)
    monkeypatch.setattr(planning, "device_memory", lambda device, ranks_per_node: host)

    model = TinyViT(**SMALL)
    model.example_input_array = torch.randn(4, 3, 16, 16)
    ranks = RankContext(mesh=mesh, device=torch.device("cpu"))
    chosen, lines = {}, {}
    for budget in (None, 1):
        asked = ParallelConfig(checkpointing=CheckpointingPolicy(blocks=True, memory_budget=budget))
        resolved = resolve_config(asked, torch.device("cpu"))
        resolved_budget = agreed_budget(budget, ranks)
        assert resolved_budget == resolve_budget(budget, host)
        planned = plan_before_sharding(model, resolved, resolve_flag("32-true"), ranks, resolved_budget)
        assert {b.modes for b in planned.measured.profile.blocks} == {frozenset({"full"})}  # only what will run
        chosen[budget] = (planned.resolved.blocks_per_unit, planned.kept_gathered, planned.units_choice)
        assert planned.budget == resolved_budget
        every = [b.name for b in planned.measured.profile.blocks]
        lines[budget] = describe_prediction(planned.measured, every, True, budget=planned.budget)[1]
    assert chosen[None][0] > 1 or chosen[None][1], chosen
    assert chosen[1][:2] == (1, ()) and "no larger unit fits 0.0 MiB" in chosen[1][2], chosen
    # The setup summary names the one budget, and says when the predicted peak is over it.
    assert "over the memory_budget of 0.0 MiB" in lines[1] and "over" not in lines[None], lines


@pytest.mark.parametrize("budget", [0.5, 2**30])
def test_memory_budget_is_accepted_without_auto(budget):
    assert CheckpointingPolicy(blocks=True, memory_budget=budget).memory_budget == budget


def test_plan_memory_resolves_its_budget_as_memory_budget_does():
    model = TinyViT(**SMALL)
    x = torch.empty(4, 3, 16, 16, device="meta")
    assert plan_memory(model, x, device_memory=1, memory_fraction=0.5).budget == resolve_budget(0.5, GIB) == GIB // 2
    assert plan_memory(model, x, device_memory=1, memory_fraction=123 * MIB).budget == 123 * MIB  # bytes
    with pytest.raises(ValueError, match=r"`memory_fraction=1.5` as a float is a fraction"):
        plan_memory(model, x, device_memory=1, memory_fraction=1.5)


def test_every_rank_plans_for_the_smallest_budget_and_applies_rank_zeros_plan(mesh):
    """One budget for the ranks: the smallest any rank resolved (free host memory differs by rank); one plan: rank
    0's, whatever this rank's search found (a first-step batch may differ by rank; the units must not).
    Mutation tried: the plan not broadcast (``ranks.broadcast`` dropped in ``plan_before_sharding``)."""
    from lightning_vitscale.distributed import RankContext
    from lightning_vitscale.memory.plan_search import BlockPlan
    from lightning_vitscale.sharding.planning import agreed_budget, plan_before_sharding

    poorer_rank = RankContext(mesh=mesh, agree_max=lambda value: max(value, -123 * MIB))  # another rank: 123 MiB
    assert agreed_budget(None, poorer_rank) == agreed_budget(GIB, poorer_rank) == 123 * MIB
    assert agreed_budget(10 * MIB, poorer_rank) == 10 * MIB
    rank_zeros = BlockPlan(("full", "selective"), resharded=2, per_unit=1)
    ranks = RankContext(mesh=mesh, broadcast=lambda plan: rank_zeros)
    model = TinyViT(**SMALL)
    model.example_input_array = torch.randn(4, 3, 16, 16)
    planned = plan_before_sharding(model, resolve_config(ParallelConfig(), torch.device("cpu")),
                                   resolve_flag("32-true"), ranks, 2**40)  # this rank alone: nothing checkpointed
    assert planned.auto is not None and planned.auto.choice is not None
    assert planned.auto.choice.blocks == rank_zeros and planned.resolved.blocks_per_unit == 1
    assert planned.resolved.checkpoint_choice == {"blocks.0": "full", "blocks.1": "selective"}


class ForwardBranching(TinyViT):
    """A ``forward`` that decides on a value: its step cannot run on fake tensors at all."""

    def forward(self, x):
        return super().forward(x if x.sum() > 0 else -x)


def test_the_default_takes_the_recipes_plan_where_the_step_cannot_be_measured_and_auto_raises(mesh):
    """Nothing to plan from: ``VitScaleStrategy()``'s default warns and checkpoints every block (the recipe's
    checkpointing); on this one rank the blocks stay gathered in one unit on compute copies (units of their own shard
    nothing), and the plan it reports says so. An explicit ``activation_checkpointing="auto"`` raises, naming the
    fix. Mutations tried: the default's planner ``required`` (it raised); the hint without ``briefly`` (torch's
    lines of advice in it)."""
    from lightning_vitscale.distributed import RankContext
    from lightning_vitscale.memory.measurement import MeasurementError
    from lightning_vitscale.sharding.planning import plan_before_sharding

    model = ForwardBranching(**SMALL)
    model.example_input_array = torch.randn(4, 3, 16, 16)
    ranks, cpu, flag = RankContext(mesh=mesh), torch.device("cpu"), resolve_flag("32-true")
    with pytest.warns(UserWarning, match=r"could not run ForwardBranching's step on fake tensors .* every block"
                      r" checkpointed \(if the activations fit, pass activation_checkpointing=False") as warned:
        planned = plan_before_sharding(model, resolve_config(ParallelConfig(), cpu), flag, ranks, 2**40)
    # torch's own error runs on for lines of debugging advice: one line of it, and where it came from (briefly)
    assert all("\n" not in str(w.message) and "TORCH_LOGS" not in str(w.message) for w in warned)
    assert planned.auto is not None and planned.auto.choice is not None
    assert planned.auto.choice.blocks.modes == ("full", "full") and planned.auto.choice.blocks.resharded == 0
    assert planned.keeps_every_unit and planned.auto.choice.plan is None
    assert "auto: 2 full + 0 selective of 2 blocks checkpointed, 1 of 1 units kept gathered for backward, all in" \
        " one unit" in planned.auto.describe()
    asked = ParallelConfig(checkpointing=CheckpointingPolicy(blocks="auto"))
    with pytest.raises(MeasurementError, match="could not measure ForwardBranching on fake tensors.*Pass activation"):
        plan_before_sharding(model, resolve_config(asked, cpu), flag, ranks, 2**40)


def _random_choice(options: list[int]) -> int:
    """torchvision's detection transform picks its training size so: an ``int`` of a random draw."""
    return options[int(torch.empty(1).uniform_(0.0, float(len(options))).item())]


def test_a_data_dependent_guard_is_told_in_one_line_with_where_it_came_from():
    """torch's error for a step that branches on a value runs on for ten lines of debugging advice, which the setup
    summary and the default's fallback warning carried whole; ``briefly`` keeps its first line and where in the
    user's code it came from. Mutation seen failing: ``briefly`` returning ``str(error)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from lightning_vitscale.memory.planning_batch import briefly

    with pytest.raises(Exception) as raised, FakeTensorMode(shape_env=ShapeEnv()):
        _random_choice([224, 256])
    told = briefly(raised.value)
    assert "\n" not in told and "TORCH_LOGS" not in told, told
    assert told.startswith(f"{type(raised.value).__name__}: Could not extract specialized integer"), told
    assert told.endswith("in _random_choice)") and "test_planning_batch.py:" in told, told
