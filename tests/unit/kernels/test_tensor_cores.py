"""The tensor-core report names every odd GEMM dimension, on plain and meta-device models."""

from __future__ import annotations

import timm
import torch
from torch import nn

from lightning_vitscale.cli.demo import Block, TinyViT
from lightning_vitscale.kernels.tensor_cores import tensor_core_report


def test_clean_model_has_no_lines():
    with torch.device("meta"):
        assert tensor_core_report(TinyViT(dim=128, classes=16)) == []


def test_names_each_odd_dimension():
    with torch.device("meta"):
        model = TinyViT(dim=64, classes=10)  # head: 64 -> 10; Block(64, heads=8) has head_dim 8
    assert tensor_core_report(model) == ["head: Linear out_features=10 (not a multiple of 8)"]


def test_convs_attention_and_hand_written_heads():
    model = nn.Sequential(
        nn.Conv2d(3, 96, 3),  # GEMM reduction 3 x 3 x 3 = 27
        nn.Conv2d(96, 96, 3, groups=96),  # depthwise: not a tensor-core GEMM
        nn.Conv2d(3, 96, 16, 16),  # RGB patch embedding: reduction 3 x 16 x 16 = 768 is fine
        nn.MultiheadAttention(96, 16),  # head_dim 6
        Block(96, 8),  # qkv 96 -> 288 with 8 heads: head_dim 12
    )
    model[4].num_heads = 8
    assert tensor_core_report(model) == [
        "0: Conv2d in_channels*kernel_size=27 (not a multiple of 8)",
        "3: MultiheadAttention head_dim=6 (not a multiple of 8)",
        "4: Block head_dim=12 (not a multiple of 8)",
    ]
    assert tensor_core_report(model, multiple=2) == ["0: Conv2d in_channels*kernel_size=27 (not a multiple of 2)"]


def test_timm_vit_on_meta():
    with torch.device("meta"):
        vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000)
    lines = tensor_core_report(vit)  # 192 wide, 3 heads of 64, 1000 classes (a multiple of 8)
    assert "head: Linear out_features=1000 (not a multiple of 16)" in tensor_core_report(vit, multiple=16)
    assert lines == []
