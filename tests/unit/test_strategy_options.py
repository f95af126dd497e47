"""Bad options fail at construction with a message that names the cause and the fix."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_vitscale import KernelPolicy, VitScaleStrategy
from lightning_vitscale.sharding import CheckpointingPolicy, ShardingPolicy, resolve_config
from lightning_vitscale.sharding.sharded_model import PlannedStepOutOfMemoryError
from tests.helpers.models import Classifier, loader


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"blocks": "Block"}, TypeError, "set of nn.Module classes or a callable"),
        ({"blocks": {int}}, TypeError, "must contain nn.Module subclasses"),
        ({"blocks": set()}, TypeError, "an empty set"),
        ({"reshard_after_forward": "yes"}, TypeError, "must be None, a bool or an int"),
        ({"reshard_after_forward": 0}, ValueError, "must be >= 1"),
        ({"activation_checkpointing": 0}, ValueError, "use False to turn checkpointing off"),
        ({"activation_checkpointing": "all"}, TypeError, "must be True, False, 'full', 'selective', an int k >= 1"),
        ({"blocks_per_unit": 0}, ValueError, r"`blocks_per_unit=0` must be None or an int >= 1"),
        ({"blocks_per_unit": True}, ValueError, r"`blocks_per_unit=True` must be None or an int >= 1"),
        ({"blocks_per_unit": "auto"}, ValueError, r"``None``: as ``priority`` says"),
        ({"priority": "throughput"}, ValueError, r"`priority='throughput'` is not supported.*\"memory\": the recipe"),
    ],
)
def test_strategy_rejects_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        VitScaleStrategy(**kwargs)


def test_keyword_only_constructor():
    with pytest.raises(TypeError):
        VitScaleStrategy({nn.Linear})  # type: ignore[misc]


@pytest.mark.parametrize(
    "selector, expected",
    [(True, [0, 1, 2, 3, 4, 5]), (False, []), (1, [0, 1, 2, 3, 4, 5]), (2, [1, 3, 5]), (3, [2, 5])],
)
def test_every_kth_block(selector, expected):
    policy = CheckpointingPolicy(selector)
    assert [i for i in range(6) if policy.mode(i, f"b{i}", nn.Identity()) is not None] == expected


def test_predicate_checkpointing():
    policy = CheckpointingPolicy(lambda name, module: name.endswith("1"))
    assert [i for i in range(3) if policy.mode(i, f"blocks.{i}", nn.Identity()) is not None] == [1]


def test_checkpointing_modes_per_block():
    """``"selective"`` for every block, ``"full"`` as ``True``, and a callable choosing the mode block by block."""
    names = [f"blocks.{i}" for i in range(3)]
    assert [CheckpointingPolicy("selective").mode(i, n, nn.Identity()) for i, n in enumerate(names)] == [
        "selective"] * 3
    assert [CheckpointingPolicy("full").mode(i, n, nn.Identity()) for i, n in enumerate(names)] == ["full"] * 3
    per_block = CheckpointingPolicy(lambda name, _: {"blocks.0": "selective", "blocks.1": True}.get(name, False))
    assert [per_block.mode(i, n, nn.Identity()) for i, n in enumerate(names)] == ["selective", "full", None]
    with pytest.raises(ValueError, match="a string must be 'full' or 'selective'"):
        CheckpointingPolicy(lambda name, _: "some").mode(0, "blocks.0", nn.Identity())


def test_sharding_policy_accepts_classes_and_predicates():
    assert ShardingPolicy(blocks={nn.TransformerEncoderLayer}).blocks == {nn.TransformerEncoderLayer}
    assert callable(ShardingPolicy(blocks=lambda n, m: False).blocks)


def test_unknown_kernels_mode_fails_at_construction():
    with pytest.raises(ValueError, match="`kernels='fast'` is not supported. Choose one of: auto, eager"):
        VitScaleStrategy(kernels="fast")  # type: ignore[arg-type]


def test_config_stays_the_request_and_setup_resolves_it_apart(mesh):
    strategy = VitScaleStrategy(kernels="auto", activation_checkpointing=2)
    requested = strategy.config
    assert requested.kernels == "auto" and strategy.resolved is None  # the device is not known yet
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Classifier("encoder"), loader(n=4))
    resolved = strategy.resolved
    assert resolved is not None and resolved.requested is requested  # the request, unchanged
    assert resolved.kernels == KernelPolicy()  # "auto" on CPU: eager, SDPA, the user's optimizer
    assert (resolved.blocks_per_unit, resolved.prefetch) == (1, 1)  # CPU: one unit ahead
    assert strategy.config is requested and strategy.config.kernels == "auto"


def test_priority_resolves_the_settings_left_at_none_and_the_ones_set_win():
    """``"speed"`` (the default) leaves checkpointing, units and reshard to the planner; ``"memory"`` is the recipe
    (every block full, its own unit, resharded); a setting passed wins over either."""
    def resolved(**kwargs):
        return resolve_config(VitScaleStrategy(**kwargs).config, torch.device("cpu"))

    speed, memory = resolved(), resolved(priority="memory")
    assert (speed.checkpointing.blocks, speed.planner_units, speed.planner_keeps) == ("auto", True, True)
    assert (memory.checkpointing.blocks, memory.blocks_per_unit, memory.planner_units, memory.planner_keeps) == (
        True, 1, False, False)
    pinned = resolved(priority="memory", activation_checkpointing="selective", blocks_per_unit=3)
    assert (pinned.checkpointing.blocks, pinned.blocks_per_unit, pinned.planner_units) == ("selective", 3, False)
    users = resolved(activation_checkpointing=True, reshard_after_forward=True)
    assert (users.checkpointing.blocks, users.planner_units, users.planner_keeps) == (True, True, False)
    assert VitScaleStrategy().config.checkpointing.blocks is None  # the request stays what was asked


class OutOfMemoryInBackward(Classifier):
    def backward(self, loss, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a faked allocator failure)")


@pytest.mark.parametrize("priority", ["speed", "memory"])
def test_an_out_of_memory_step_planned_for_speed_names_the_fix(mesh, priority):
    """Where the planner's prediction was wrong on a GPU, the step's out-of-memory error names the recipe's argument
    and a smaller budget, and is still a ``torch.OutOfMemoryError`` with the allocator's text; under the recipe's
    plan the error is torch's own. Mutation tried: ``optimizer_step`` without ``step_errors_named``."""
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(priority=priority), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory. Tried to allocate 2.00 GiB") as raised:
        trainer.fit(OutOfMemoryInBackward("encoder"), loader(n=4))
    named = isinstance(raised.value, PlannedStepOutOfMemoryError)
    assert named is (priority == "speed")
    if named:
        text = str(raised.value)
        assert 'VitScaleStrategy(priority="memory")' in text and "memory_budget=" in text, text
        assert "planned this step for speed within memory_budget =" in text and "auto: " in text, text
