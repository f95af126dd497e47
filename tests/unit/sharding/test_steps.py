"""The pipeline's ``apply_*`` steps report what they did, and setup resolves the request without changing it."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import ParallelConfig, ResolvedConfig, resolve_config
from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode
from lightning_vitscale.sharding.checkpointing_settings import CheckpointingPolicy
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from lightning_vitscale.sharding.settings import ShardingPolicy
from lightning_vitscale.sharding.steps import apply_ac
from tests.helpers.models import EncoderClassifier

CPU = torch.device("cpu")


def test_apply_ac_asks_for_every_block_in_order_and_reports_what_it_checkpointed():
    blocks = [(f"b{i}", nn.Linear(2, 2)) for i in range(4)]
    blocks[3][1].gradient_checkpointing = True  # as HF layers mark themselves
    asked = []

    def mode_of(index, name, _):
        asked.append((index, name))
        return {0: "selective", 2: "full", 3: "full"}.get(index)

    facts = apply_ac(blocks, mode_of)
    assert asked == [(0, "b0"), (1, "b1"), (2, "b2"), (3, "b3")]
    assert facts.modes == {"b0": "selective", "b2": "full"} and facts.self_checkpointed == ["b3"]
    assert [checkpoint_mode(block) for _, block in blocks[:3]] == ["selective", None, "full"]


def test_resolving_leaves_the_request_as_it_was():
    requested = ParallelConfig(sharding=ShardingPolicy(blocks_per_unit=2), kernels="auto")
    resolved = resolve_config(requested, CPU)
    assert requested.kernels == "auto" and resolved.requested is requested
    assert resolved.kernels == KernelPolicy() and (resolved.blocks_per_unit, resolved.prefetch) == (2, 1)
    assert resolve_config(requested, CPU) == resolved  # a second setup resolves the same request alike


def test_a_choice_made_at_setup_is_what_the_pipeline_checkpoints(mesh):
    """``"auto"``'s blocks reach the pipeline as a name -> mode mapping (no selector rebuilt around a lambda)."""
    model = EncoderClassifier(depth=4)
    asked = ParallelConfig(checkpointing=CheckpointingPolicy(blocks="auto"))
    chosen = {"encoder.layers.1": "selective", "encoder.layers.3": "full"}
    resolved = dataclasses.replace(resolve_config(asked, CPU), checkpoint_choice=chosen, blocks_per_unit=2)
    assert isinstance(resolved, ResolvedConfig) and asked.checkpointing.blocks == "auto"
    done = parallelize(OuterUnit(model), model, mesh, resolved, resolve_flag("32-true"), CPU)
    assert done.plan.checkpointed == ["encoder.layers.1", "encoder.layers.3"]
    assert done.plan.selective == ["encoder.layers.1"]
    assert (done.plan.units, done.plan.blocks_per_unit) == (3, 2)
    assert [checkpoint_mode(block) for block in model.encoder.layers] == [None, "selective", None, "full"]
