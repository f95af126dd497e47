"""Named ViT configs match their published / nominal parameter counts (built on the meta device)."""

from __future__ import annotations

import pytest
import torch

from examples.models.vit import VIT_SIZES, VisionTransformer

pytestmark = pytest.mark.timeout(120)

# 1000 classes at 224 px, as in the papers (ViT: Dosovitskiy et al. 2021; g/G: Zhai et al. 2022).
EXPECTED = {
    "vit-b16": 86.6e6,
    "vit-l16": 304.3e6,
    "vit-h14": 632.0e6,
    "vit-g14": 1011e6,
    "vit-G14": 1843e6,
    "vit-5b": 5e9,
    "vit-10b": 10e9,
    "vit-22b": 21.7e9,  # ViT-22B's shape without its parallel layers and qk-norm: 21.7B (Dehghani et al. 2023)
    "vit-25b": 25e9,
    "vit-60b": 60e9,
    "vit-120b": 120e9,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_param_count_within_2_percent(name: str) -> None:
    with torch.device("meta"):
        model = VisionTransformer.from_size(name, img_size=224, in_chans=3, num_classes=1000)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - EXPECTED[name]) / EXPECTED[name] < 0.02, f"{name}: {n / 1e6:.1f}M"


@pytest.mark.parametrize("name", sorted(n for n in VIT_SIZES if n.startswith("vit-")))
def test_big_configs_use_multiples_of_8(name: str) -> None:
    s = VIT_SIZES[name]
    assert s.embed_dim % s.num_heads == 0
    if name in ("vit-5b", "vit-10b", "vit-22b", "vit-25b", "vit-60b", "vit-120b"):
        assert s.embed_dim % 8 == 0 and s.num_heads % 8 == 0 and s.mlp_dim % 8 == 0


def test_blocks_are_one_modulelist_of_one_class() -> None:
    """The strategy auto-detects repeated blocks: they must be a ModuleList of a single class."""
    with torch.device("meta"):
        model = VisionTransformer.from_size("vit-b16", img_size=224, in_chans=3, num_classes=1000)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len({type(b) for b in model.blocks}) == 1 and len(model.blocks) == 12
