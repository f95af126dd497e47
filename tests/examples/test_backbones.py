"""The ViTDet backbone (windowed + global blocks, interpolated position embedding) and the MViTv2-S build."""

from __future__ import annotations

import pytest
import torch

from examples.models.video import MViTv2S
from examples.models.vitdet import ViTDet
from examples.models.vitdet_backbone import (
    ViTDetBackbone,
    WindowBlock,
    default_global_blocks,
    window_partition,
    window_unpartition,
)
from lightning_vitscale import find_blocks

pytestmark = pytest.mark.timeout(120)


def test_global_blocks_follow_vitdet() -> None:
    """ViTDet (Li et al. 2022, detectron2 configs): B 2,5,8,11; L 5,11,17,23; H 7,15,23,31."""
    assert default_global_blocks(12) == (2, 5, 8, 11)
    assert default_global_blocks(24) == (5, 11, 17, 23)
    assert default_global_blocks(32) == (7, 15, 23, 31)
    assert default_global_blocks(4) == (3,)


def test_vit_h_backbone_blocks_of_both_kinds_are_found_for_sharding() -> None:
    with torch.device("meta"):
        det = ViTDet("vit-h14", 1024, 16, 3, 80, fpn_dim=256, strides=(8, 16, 32), window_size=14)
    blocks = det.backbone.blocks
    assert [b.window_size for b in blocks].count(0) == 4 and {b.window_size for b in blocks} == {0, 14}
    found = {id(m) for _, m in find_blocks(det)}
    assert all(id(b) in found for b in blocks), "every windowed and every global block is its own unit"


def test_window_partition_round_trips_with_padding() -> None:
    x = torch.randn(2, 5, 7, 3)
    windows, padded = window_partition(x, 4)
    assert windows.shape == (2 * 2 * 2, 16, 3) and padded == (8, 8)
    torch.testing.assert_close(window_unpartition(windows, 4, padded, (5, 7)), x)


def test_windowed_block_attends_only_within_its_window() -> None:
    torch.manual_seed(0)
    windowed, global_ = WindowBlock(16, 2, 32, window_size=4), WindowBlock(16, 2, 32, window_size=0)
    global_.load_state_dict(windowed.state_dict())
    x = torch.randn(1, 8, 8, 16)
    x2 = x.clone()
    x2[0, 7, 7] = torch.randn(16) * 3  # a token in the bottom-right window (a constant shift LayerNorm removes)
    with torch.no_grad():
        assert torch.equal(windowed(x)[0, :4, :4], windowed(x2)[0, :4, :4])  # top-left window unaffected
        assert (global_(x)[0, :4, :4] - global_(x2)[0, :4, :4]).abs().max() > 1e-4  # a global block sees it


def test_position_embedding_is_interpolated_to_any_input_size() -> None:
    torch.manual_seed(0)
    bb = ViTDetBackbone(64, 8, 3, 32, 4, 2, 64, window_size=4)
    assert torch.equal(bb.abs_pos(8, 8), bb.pos_embed.view(1, 8, 8, 32))
    assert bb.abs_pos(6, 10).shape == (1, 6, 10, 32)
    assert bb(torch.randn(2, 3, 48, 80)).shape == (2, 32, 6, 10)
    with pytest.raises(ValueError, match="not a multiple of patch_size 8: pad it"):
        bb(torch.randn(1, 3, 50, 64))


def test_mvit_v2_s_is_torchvisions_architecture() -> None:
    from torchvision.models.video import mvit_v2_s

    with torch.device("meta"):
        ours, theirs = MViTv2S(224, 16, 400), mvit_v2_s(num_classes=400)
    shapes = {k.removeprefix("net."): v.shape for k, v in ours.state_dict().items()}
    assert shapes == {k: v.shape for k, v in theirs.state_dict().items()}
    with pytest.raises(ValueError, match="img_size % 32 == 0"):
        MViTv2S(48, 8, 10)
