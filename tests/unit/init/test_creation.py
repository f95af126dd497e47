"""Recording a model's own init on meta, replaying it on shards, the init= policy, and the 120B example's creation."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lightning_vitscale.init.creation import ModelCreation
from lightning_vitscale.init.replay import recording, replay, tensor_seed
from lightning_vitscale.init.settings import InitSettings

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[3]


def test_init_mode_is_validated_with_the_choices():
    with pytest.raises(ValueError, match="init='fast'.*auto, exact, meta"):
        InitSettings("fast")  # type: ignore[arg-type]
    from lightning_vitscale import VitScaleStrategy

    with pytest.raises(ValueError, match="Choose one of: auto, exact, meta"):
        VitScaleStrategy(init="lazy")


def test_auto_is_exact_only_when_one_copy_fits():
    gib = 2**30
    assert InitSettings("auto").resolve(10 * gib, 100 * gib, host_copies=1.0) == "exact"
    assert InitSettings("auto").resolve(10 * gib, 100 * gib, host_copies=9.0) == "meta"  # 90 GiB > 80% of 100 GiB
    assert InitSettings("auto").resolve(480 * gib, 500 * gib) == "meta"
    assert InitSettings("exact").resolve(480 * gib, 1 * gib) == "exact"  # forced


def test_recorder_lowers_nn_init_to_replayable_steps():
    with torch.device("meta"), recording() as recorder:
        linear = nn.Linear(64, 32)  # kaiming_uniform_(a=sqrt(5)) -> uniform_(-1/8, 1/8) from the global fan-in
        head = nn.Linear(32, 4)
        nn.init.trunc_normal_(head.weight, std=0.02)  # torch skips this on meta: recorded by its wrapped helper
        nn.init.constant_(head.bias, 0.3)
        nn.init.orthogonal_(linear.weight)  # not elementwise
        pos = nn.Parameter(torch.randn(1, 4, 8) * 0.02)
        part = nn.Parameter(torch.zeros(4, 4))
        with torch.no_grad():
            part[0].fill_(1.0)  # a write to part of the tensor
        clone = copy.deepcopy(head)
    assert recorder.recipe_of(linear.bias).steps == [("uniform_", (-0.125, 0.125), {})]
    assert recorder.recipe_of(head.weight).steps == [("trunc_normal_", (0.0, 0.02, -2.0, 2.0), {})]
    assert recorder.recipe_of(head.bias).steps == [("fill_", (0.3,), {})]
    assert recorder.recipe_of(clone.weight).steps == recorder.recipe_of(head.weight).steps
    assert recorder.recipe_of(pos).steps == [("normal_", (0.0, 1.0), {}), ("mul_", (0.02,), {})]
    assert "orthogonal_" in recorder.recipe_of(linear.weight).broken
    assert "part of the tensor" in recorder.recipe_of(part).broken
    assert nn.init.orthogonal_.__name__ == "orthogonal_" and nn.init.orthogonal_.__module__ == "torch.nn.init"


def test_replay_on_shards_gives_the_distribution_and_distinct_shards():
    with torch.device("meta"), recording() as recorder:
        weight = nn.Parameter(torch.empty(4096, 256))
        nn.init.normal_(weight, std=0.05)
    recipe = recorder.recipe_of(weight)
    shards = [torch.empty(1024, 256) for _ in range(4)]
    for index, shard in enumerate(shards):
        replay(shard, recipe, tensor_seed(7, "weight", index))
    full = torch.cat(shards)
    assert abs(full.std().item() - 0.05) < 0.001 and abs(full.mean().item()) < 0.001
    assert not torch.equal(shards[0], shards[1])
    again = torch.empty(1024, 256)
    replay(again, recipe, tensor_seed(7, "weight", 0))
    assert torch.equal(again, shards[0])  # replicas (same index) draw identical values


def _vit_120b_module():
    """The example's LightningModule with the 120B config's model arguments (data links: ImageNet 224 px)."""
    from examples.classification import ViTClassifier

    config = yaml.safe_load((REPO / "examples/configs/classification_vit_120b.yaml").read_text())
    nodes, devices = config["trainer"]["num_nodes"], config["trainer"]["devices"]
    return ViTClassifier(**config["model"], num_classes=1000, in_chans=3, img_size=224), nodes * devices


def test_vit_120b_example_is_created_sharded():
    """Every rank builds the 120B config on meta (no bytes), every init call is recorded for the shards, and the
    bytes each of the 128 ranks then allocates are its FSDP2 dim-0 chunks (plus the tiny replicated fp32 norms)."""
    module, world = _vit_120b_module()
    creation = ModelCreation(module, InitSettings("meta"), rank=5, world_size=1, host_copies=1.0)
    with creation.context():
        module.configure_model()
    created = creation.result
    assert created is not None and created.path == "meta"
    params = list(module.parameters())
    assert all(p.is_meta for p in params)
    full = sum(p.numel() * 4 for p in params)  # fp32 master weights under bf16-mixed
    assert 118e9 * 4 < full < 122e9 * 4
    assert InitSettings("auto").resolve(full, 512 * 2**30) == "meta"  # does not fit a 512 GiB host: no full copy
    assert all(recipe is not None and recipe.initialised for recipe in created.recipes.values())
    norms = {id(p) for m in module.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    per_rank = [0] * world
    for p in params:
        if id(p) in norms:  # replicated on every rank (fp32 norms outside the units)
            per_rank = [b + p.numel() * 4 for b in per_rank]
            continue
        for rank, chunk in enumerate(torch.chunk(p, world)):  # FSDP2's dim-0 slicing
            per_rank[rank] += chunk.numel() * 4
    largest = max(per_rank)
    assert largest <= full / world * 1.01, (largest, full / world)
    assert math.isclose(largest / 2**30, 3.505, abs_tol=0.001)  # the README's figures
    assert math.isclose(full / 2**30, 445.6, abs_tol=0.1)
