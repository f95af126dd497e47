"""Sharding layouts: bad options fail at construction naming the valid values; shard-group sizes; the traffic
accounting on hand-computed cases (the distributed test checks it against the collectives really issued)."""

from __future__ import annotations

import pytest
import torch

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding.settings import shard_group_size
from lightning_vitscale.sharding.traffic import Unit, step_traffic


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"sharding": "hybird"}, ValueError, "Choose one of: 'full', 'hybrid', or an int that divides the world"),
        ({"sharding": 0}, ValueError, "shard-group size and must be >= 1"),
        ({"sharding": True}, TypeError, "must be one of"),
        ({"sharding": 2.0}, TypeError, "or a shard-group size"),
        ({"offload": "gpu"}, ValueError, "Choose one of: \\(None, 'cpu'\\)"),
    ],
)
def test_bad_layout_options_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        VitScaleStrategy(**kwargs)


@pytest.mark.parametrize(
    "layout, world, per_node, expected",
    [("full", 8, 4, 8), ("hybrid", 8, 4, 4), ("hybrid", 4, 4, 4), (2, 8, 4, 2), (8, 8, 4, 8), ("full", 1, 1, 1)],
)
def test_shard_group_size(layout, world, per_node, expected):
    assert shard_group_size(layout, world, per_node) == expected


@pytest.mark.parametrize(
    "layout, world, per_node, message",
    [
        (3, 8, 4, "`sharding=3` asks for shard groups of 3 ranks, which does not divide the world size 8."
         " Choose one of: 'full', 'hybrid', or an int among \\[1, 2, 4, 8\\]"),
        (16, 8, 4, "does not divide the world size 8"),
        ("hybrid", 6, 4, "shards within each node \\(4 ranks per node\\), which does not divide the world size 6"),
    ],
)
def test_shard_group_size_must_divide_the_world(layout, world, per_node, message):
    with pytest.raises(ValueError, match=message):
        shard_group_size(layout, world, per_node)


FP32 = resolve_flag("32-true")
BF16 = resolve_flag("bf16-mixed")
UNIT = [Unit((torch.Size([3, 2]),), reshard_after_forward=True)]  # dim 0 padded to 4 rows: 8 elements


@pytest.mark.parametrize(
    "units, norms, precision, shard, expected",
    [
        # hybrid 2x2, fp32, 32-byte buffer: 2 all-gathers + 1 reduce-scatter of 32 * 1/2 inside the node;
        # the 16-byte reduced shard all-reduced across nodes: 2 * 16 * 1/2.
        (UNIT, 0, FP32, 2, (48, 16)),
        # full over 4 ranks on 2 nodes: every collective spans the nodes, 3 x 32 * 3/4.
        (UNIT, 0, FP32, 4, (0, 72)),
        # bf16 O2: gathers in bf16 (16 bytes), reduces in fp32 (32 bytes).
        (UNIT, 0, BF16, 2, (8 + 8 + 16, 16)),
        # the root keeps its gathered parameters for backward: one all-gather only.
        ([Unit((torch.Size([3, 2]),), reshard_after_forward=False)], 0, FP32, 2, (32, 16)),
        # 10 fp32 norm elements, all-reduced within the node then across: 2 * 40 * 1/2 each.
        ([], 10, FP32, 2, (40, 40)),
    ],
)
def test_step_traffic_by_hand(units, norms, precision, shard, expected):
    traffic = step_traffic(units, norms, precision, world_size=4, shard_size=shard, ranks_per_node=2, rank=3)
    assert (traffic.intra_node, traffic.inter_node) == expected


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_offload_policy_reaches_every_unit_and_the_optimizer_steps(mesh, offload):
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from lightning_vitscale._compat import fsdp_param_groups
    from lightning_vitscale.precision.settings import resolve_flag
    from lightning_vitscale.sharding import ParallelConfig, ShardingPolicy
    from lightning_vitscale.sharding.outer_unit import OuterUnit
    from lightning_vitscale.sharding.parallelize import parallelize
    from tests.helpers.models import EncoderClassifier

    torch.manual_seed(0)
    model = EncoderClassifier(dim=32, depth=2)
    root = OuterUnit(model)
    parallelize(root, model, mesh, ParallelConfig(sharding=ShardingPolicy(offload=offload)), resolve_flag("32-true"),
                torch.device("cpu"))
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 3
    policies = [fsdp_param_groups(unit)[0].offload_policy for unit in units]
    assert all(isinstance(p, CPUOffloadPolicy) == (offload == "cpu") for p in policies)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    before = model.head.weight.full_tensor().clone()
    root(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model.head.weight.full_tensor())
