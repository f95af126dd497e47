"""The planner's tensor-parallel split: one TP rank's share of each block, measured on a twin, and its all-reduces.

Mutations seen failing: the column-wise input hooks dropped (backward all-reduces 0 bytes instead of 34816); the
row-wise Linears left whole (the twin's forward fails on mismatched matmul shapes).
"""

from __future__ import annotations

import pytest
import torch

from lightning_vitscale.memory.planner import plan_memory, step_inputs


def timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        return VisionTransformer(img_size=32, patch_size=8, num_classes=10, embed_dim=64, depth=2, num_heads=4)


def test_blocks_hold_one_tensor_parallel_ranks_share_and_norms_stay_whole():
    model = timm_vit()
    x = torch.empty(4, 3, 32, 32, device="meta")
    whole = step_inputs(model, x, world_size=1, precision="32-true")
    split = step_inputs(model, x, world_size=1, precision="32-true", tensor_parallel=2)
    linears = sum(p.numel() for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)
                  for name, p in m.named_parameters() if not (name == "bias" and m is model.blocks[0].attn.proj
                                                                or name == "bias" and m is model.blocks[0].mlp.fc2))
    rest = sum(p.numel() for p in model.blocks[0].parameters()) - linears
    numel = sum(torch.Size(s).numel() for s in split.layout.blocks[0])
    assert numel == linears // 2 + rest  # row-wise biases and norms whole
    assert split.layout.outer == whole.layout.outer
    assert model.blocks[0].attn.num_heads == 4 and model.blocks[0].attn.qkv.weight.shape[0] == 192  # untouched
    # Activations: attention and MLP hidden are 1/2, the block's input whole.
    assert split.profile.blocks[0].input == whole.profile.blocks[0].input
    assert split.profile.blocks[0].saved < 0.75 * whole.profile.blocks[0].saved


def test_all_reduces_per_block_are_the_row_wise_outputs_and_column_wise_input_gradients():
    from transformers import ViTConfig, ViTForImageClassification

    tokens_bytes = 4 * 17 * 64 * 4  # batch x (16 patches + cls) x width x fp32
    model = timm_vit()
    x = torch.empty(4, 3, 32, 32, device="meta")
    block = step_inputs(model, x, world_size=2, precision="32-true", tensor_parallel=2).tensor.blocks[0]
    assert (block.forward, block.backward, block.calls) == (2 * tokens_bytes, 2 * tokens_bytes, 4)
    assert block.recompute["full"] == tokens_bytes  # the recompute stops before the MLP's all-reduce
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, num_labels=10)
    with torch.device("meta"):
        hf = ViTForImageClassification(config)
    hf_block = step_inputs(hf, x, world_size=2, precision="32-true", tensor_parallel=2).tensor.blocks[0]
    assert hf_block.backward == 4 * tokens_bytes and hf_block.calls == 6  # separate q, k, v: one each


def test_plan_memory_counts_every_rank_and_refuses_a_tensor_parallel_that_does_not_divide_them():
    model = timm_vit()
    x = torch.empty(4, 3, 32, 32, device="meta")
    plan = plan_memory(model, x, world_size=4, tensor_parallel=2, precision="32-true")
    assert plan.world_size == 4 and plan.tensor_parallel == 2
    assert set(plan.traffic) == {"data_parallel", "tensor_parallel"}
    assert "4 ranks (2 data parallel x 2 tensor parallel)" in plan.summary()
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide world_size=4"):
        plan_memory(model, x, world_size=4, tensor_parallel=3)
