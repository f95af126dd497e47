"""The automatic tensor-parallel plan, read from each block family's own structure, and its refusals; the packed
projection's per-rank row order. Single process: the plan is policy (module names to roles).

Mutations seen failing: the packed qkv planned as plain colwise; the head counts left unscaled; the output
projection found first instead of last; the interleave transposed the other way; the MultiheadAttention check
removed (torchvision's block then planned its MLP only, silently)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_vitscale.discovery.tensor_plan import TensorPlanError, plan_block
from lightning_vitscale.sharding import ShardingPolicy
from lightning_vitscale.sharding.tensor_parallel import interleave_rows

PACKED = {"attn.qkv": "packed_colwise", "attn.proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


def examples_block() -> nn.Module:
    from examples.models.vit import Block

    return Block(32, 4, 64)


def timm_block() -> nn.Module:
    from timm.models.vision_transformer import Block

    return Block(32, 4, mlp_ratio=2.0)


def hf_layer(kind: str) -> nn.Module:
    from transformers import Dinov2Config, ViTConfig
    from transformers.models.dinov2.modeling_dinov2 import Dinov2Layer
    from transformers.models.vit.modeling_vit import ViTLayer

    if kind == "vit":
        return ViTLayer(ViTConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64))
    return Dinov2Layer(Dinov2Config(hidden_size=32, num_attention_heads=4, mlp_ratio=2, use_swiglu_ffn=True))


@pytest.mark.parametrize("make", [examples_block, timm_block], ids=["examples", "timm"])
def test_packed_qkv_blocks_get_megatron_roles_and_per_rank_heads(make):
    plan = plan_block("blocks.0", make(), 2, None)
    assert plan.styles == PACKED
    expected = {"attn.num_heads": 2} | ({"attn.attn_dim": 16} if make is timm_block else {})
    assert plan.attributes == expected


def test_hf_vit_layer_splits_q_k_v_and_the_output_projection():
    plan = plan_block("encoder.layer.0", hf_layer("vit"), 4, None)
    assert plan.styles == {
        "attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
        "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise",
    }
    assert plan.attributes == {"attention.num_attention_heads": 1}


def test_dinov2_swiglu_splits_gate_and_up_columnwise():
    plan = plan_block("layer.0", hf_layer("dinov2"), 2, None)
    assert {k: v for k, v in plan.styles.items() if k.startswith("mlp")} == {
        "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
    }


def test_torchvision_encoder_block_is_refused_naming_the_fix():
    from torchvision.models.vision_transformer import EncoderBlock

    block = EncoderBlock(4, 32, 64, 0.0, 0.0)
    with pytest.raises(TensorPlanError, match=r"EncoderBlock uses nn.MultiheadAttention.*tensor_plan="):
        plan_block("encoder.layers.0", block, 2, None)


def test_heads_must_divide_and_unknown_blocks_are_refused():
    with pytest.raises(TensorPlanError, match="4 heads, not divisible by tensor_parallel=3"):
        plan_block("b", examples_block(), 3, None)
    with pytest.raises(TensorPlanError, match="no attention module .* tensor_plan="):
        plan_block("b", nn.Sequential(nn.LayerNorm(4), nn.GELU()), 2, None)


def test_a_user_plan_by_patterns_or_callable():
    style = ColwiseParallel()
    plan = plan_block("b", examples_block(), 2, {"mlp.fc*": style})
    assert plan.styles == {"mlp.fc1": style, "mlp.fc2": style} and plan.family == "user patterns"
    with pytest.raises(TensorPlanError, match=r"\['nope'\] match no module"):
        plan_block("b", examples_block(), 2, {"nope": style})
    assert plan_block("b", examples_block(), 2, lambda name, block: {"attn.qkv": style}).styles == {"attn.qkv": style}


def test_interleaved_rows_give_each_rank_its_own_heads_q_k_v():
    linear = nn.Linear(1, 12)  # q, k, v of 4 features each (2 heads of 2), over 2 ranks
    with torch.no_grad():
        linear.weight.copy_(torch.arange(12.0).view(12, 1))
    interleave_rows(linear, 3, 2)
    rank0, rank1 = linear.weight.view(-1).chunk(2)
    assert rank0.tolist() == [0, 1, 4, 5, 8, 9] and rank1.tolist() == [2, 3, 6, 7, 10, 11]


def test_settings_refuse_bad_tensor_parallel_values():
    with pytest.raises(ValueError, match="must be an int >= 1"):
        ShardingPolicy(tensor_parallel=0)
    ShardingPolicy(tensor_parallel=2, layout="hybrid")  # a 3-D mesh: accepted
    with pytest.raises(TypeError, match="tensor_plan"):
        ShardingPolicy(tensor_parallel=2, tensor_plan=["attn.qkv"])  # type: ignore[arg-type]


def test_a_shard_group_that_tensor_parallelism_does_not_divide_is_refused_before_any_mesh_is_made():
    """8 ranks in shard groups of 2 cannot hold tensor-parallel groups of 4 (no process group needed: refused first)."""
    from lightning_vitscale.distributed.mesh import build_mesh

    with pytest.raises(ValueError, match=r"does not divide the shard group of 2 ranks.*\[1, 2\]"):
        build_mesh("cpu", 8, 2, tensor_parallel=4)
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        build_mesh("cpu", 6, 6, tensor_parallel=4)
