"""The ViTDet backbone as published (Li et al. 2022): a plain ViT with windowed attention in most blocks.

A few evenly spaced blocks attend globally (ViT-B: 2, 5, 8, 11; ViT-L: 5, 11, 17, 23; ViT-H: 7, 15, 23, 31),
the rest attend within non-overlapping ``window_size`` x ``window_size`` windows of the patch grid (padded up
to a multiple of the window, as in the paper). The absolute position embedding is learned for the
``pretrain_img_size`` grid and interpolated (bicubic) to whatever grid the input has, so images of any size,
landscape or portrait, go through one network. Relative position biases are not included.

``drop_path_rate`` is stochastic depth as in the ViT (``drop_path_rates``: 0 at the first block, the rate at the
last); 0 leaves the forward pass as without it.

Both kinds of block are the same class (``WindowBlock``, global when ``window_size == 0``) in one
``nn.ModuleList``, so the strategy finds and shards all of them as one repeated block type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.models.vit import Block, PatchEmbed, drop_path_rates, init_vit_weights


def default_global_blocks(depth: int) -> tuple[int, ...]:
    """ViTDet's layout: the last block of each of ``n`` equal stages is global, n = 4 from depth 12 on."""
    n = max(1, min(4, depth // 3))
    return tuple((i + 1) * depth // n - 1 for i in range(n))


def window_partition(x: Tensor, window: int) -> tuple[Tensor, tuple[int, int]]:
    """(B, H, W, D) -> (B * windows, window * window, D), zero-padding H and W up to multiples of ``window``."""
    b, h, w, d = x.shape
    ph, pw = -h % window, -w % window
    x = F.pad(x, (0, 0, 0, pw, 0, ph))
    hp, wp = h + ph, w + pw
    x = x.view(b, hp // window, window, wp // window, window, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, d), (hp, wp)


def window_unpartition(x: Tensor, window: int, padded: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """Inverse of ``window_partition``: back to (B, H, W, D), the padding cut off."""
    (hp, wp), (h, w) = padded, size
    b = x.shape[0] // (hp * wp // window // window)
    x = x.view(b, hp // window, wp // window, window, window, -1).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, hp, wp, -1)[:, :h, :w].contiguous()


class WindowBlock(Block):
    """Pre-norm transformer block on a (B, H, W, D) token grid; attention within windows, or global if 0."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, window_size: int, drop_path: float = 0.0) -> None:
        super().__init__(dim, num_heads, mlp_dim, drop_path)
        self.window_size = window_size

    def forward(self, x: Tensor) -> Tensor:
        b, h, w, d = x.shape
        y = self.norm1(x)
        if self.window_size:
            windows, padded = window_partition(y, self.window_size)
            y = window_unpartition(self.attn(windows), self.window_size, padded, (h, w))
        else:
            y = self.attn(y.reshape(b, h * w, d)).view(b, h, w, d)
        x = x + self.drop_path(y)
        return x + self.drop_path(self.mlp(self.norm2(x)))


class ViTDetBackbone(nn.Module):
    """Images (B, C, H, W), H and W multiples of ``patch_size`` -> one stride-``patch_size`` map (B, D, H/p, W/p)."""

    def __init__(
        self,
        pretrain_img_size: int,
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_dim: int,
        window_size: int,
        global_blocks: tuple[int, ...] | None = None,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if pretrain_img_size % patch_size:
            raise ValueError(f"img_size {pretrain_img_size} not divisible by patch_size {patch_size}")
        global_blocks = default_global_blocks(depth) if global_blocks is None else tuple(global_blocks)
        if any(not 0 <= i < depth for i in global_blocks):
            raise ValueError(f"global_blocks {global_blocks} must index blocks 0..{depth - 1}")
        self.patch_size, self.grid = patch_size, pretrain_img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.pos_embed = nn.Parameter(torch.empty(1, self.grid * self.grid, embed_dim))
        self.blocks = nn.ModuleList(
            WindowBlock(embed_dim, num_heads, mlp_dim, 0 if i in global_blocks else window_size, rate)
            for i, rate in enumerate(drop_path_rates(depth, drop_path_rate))
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.reset_parameters()
        self.apply(init_vit_weights)

    def reset_parameters(self) -> None:
        """Init this module's own parameters (lets a strategy re-init after meta-device materialisation)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def abs_pos(self, h: int, w: int) -> Tensor:
        """The learned grid x grid embedding resized to h x w (ViTDet's ``get_abs_pos``): (1, h, w, D)."""
        pos = self.pos_embed.view(1, self.grid, self.grid, -1)
        if (h, w) == (self.grid, self.grid):
            return pos
        pos = F.interpolate(pos.permute(0, 3, 1, 2), size=(h, w), mode="bicubic", align_corners=False)
        return pos.permute(0, 2, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] % self.patch_size or x.shape[-2] % self.patch_size:
            raise ValueError(f"input {tuple(x.shape[-2:])} is not a multiple of patch_size {self.patch_size}: pad it")
        x = self.patch_embed.proj(x).permute(0, 2, 3, 1)  # (B, h, w, D)
        x = x + self.abs_pos(x.shape[1], x.shape[2])
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x).permute(0, 3, 1, 2)
