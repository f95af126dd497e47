"""Normalization layers are found however they are written."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vitscale.discovery.blocks import find_modules
from lightning_vitscale.discovery.norms import is_normalization


class FunctionalNorm(nn.Module):
    """Third-party norm that calls F.layer_norm itself (e.g. channels-first LayerNorm2d)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.transpose(1, -1), x.shape[1:2], self.weight, self.bias).transpose(1, -1)


class LlamaRMSNorm(nn.Module):
    """Named like a norm, computes by hand."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LayerNormSubclass(nn.LayerNorm):
    pass


class ChannelsFirstAffineNorm(nn.Module):
    """A norm whose scale is shaped to broadcast over NCHW: one dimension above 1, still a norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, dim, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, 1) * self.weight


def test_all_kinds_of_norm_are_detected():
    for module in [
        nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.BatchNorm2d(4), nn.RMSNorm(4), nn.InstanceNorm2d(4, affine=True),
        LayerNormSubclass(4), FunctionalNorm(4), LlamaRMSNorm(4), ChannelsFirstAffineNorm(4), nn.LayerNorm([4, 3, 3]),
    ]:
        assert is_normalization("n", module), type(module).__name__


def test_blocks_and_linears_are_not_norms():
    block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert not is_normalization("b", block)
    assert not is_normalization("l", nn.Linear(4, 4))


def test_weight_standardized_convolutions_are_not_norms():
    """BiT, NFNet and the R50+ViT hybrids standardize their convolutions' weights with F.batch_norm inside the
    convolution's forward: convolutions, not norms (taken for norms, an NFNet's every convolution was kept fp32 and
    replicated). Mutation seen failing: without ``_scales_channels`` all three count as norms."""
    from timm.layers import ScaledStdConv2d, StdConv2d
    from timm.models import create_model
    from timm.models.resnetv2 import ResNetV2
    from transformers.models.bit.modeling_bit import WeightStandardizedConv2d

    for conv in (StdConv2d(3, 8, 3), ScaledStdConv2d(3, 8, 3), WeightStandardizedConv2d(3, 8, 3)):
        assert not is_normalization("conv", conv), type(conv).__name__
    nfnet = create_model("nf_regnet_b0", pretrained=False, num_classes=10)
    assert find_modules(nfnet, is_normalization) == []
    bit = ResNetV2(layers=[1, 1, 1, 1], num_classes=10, stem_type="fixed")  # BiT-R50x1's layout, one block a stage
    assert {type(m).__name__ for _, m in find_modules(bit, is_normalization)} == {"GroupNormAct"}


def test_timm_and_hf_norms_are_found():
    from tests.helpers.models import HFViT, timm_vit

    assert len(find_modules(timm_vit(), is_normalization)) == 9
    assert len(find_modules(HFViT(), is_normalization)) == 9
