"""Plain single-device Vision Transformer pieces (patch embed, Block, ViT) and named size configs.

Nothing here knows about sharding: the strategy finds the repeated ``Block`` modules inside the
``nn.ModuleList`` and wraps/checkpoints them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ViTSize:
    """Width/depth/heads of a named ViT; ``patch_size`` is the size's published default."""

    embed_dim: int
    depth: int
    num_heads: int
    mlp_dim: int
    patch_size: int


# Published families (Dosovitskiy et al. 2021; Zhai et al. 2022 for g/G) plus FAIR-style big dense
# configs with width and head count multiples of 8 (head dim 128) sized so the count matches the name.
VIT_SIZES: dict[str, ViTSize] = {
    "tiny": ViTSize(64, 4, 4, 128, 4),  # CPU: digits / shapes
    "small": ViTSize(128, 6, 4, 256, 4),  # CPU, a bit bigger
    "vit-b16": ViTSize(768, 12, 12, 3072, 16),  # 86.6M
    "vit-l16": ViTSize(1024, 24, 16, 4096, 16),  # 304.3M
    "vit-h14": ViTSize(1280, 32, 16, 5120, 14),  # 632.0M
    "vit-g14": ViTSize(1408, 40, 16, 6144, 14),  # 1.011B
    "vit-G14": ViTSize(1664, 48, 16, 8192, 14),  # 1.843B
    "vit-5b": ViTSize(4096, 25, 32, 16384, 14),
    "vit-10b": ViTSize(5120, 32, 40, 20480, 14),
    "vit-22b": ViTSize(6144, 48, 48, 24576, 14),  # ViT-22B's width, depth, heads and MLP (Dehghani et al. 2023)
    "vit-25b": ViTSize(8192, 31, 64, 32768, 14),
    "vit-60b": ViTSize(10240, 48, 80, 40960, 14),
    "vit-120b": ViTSize(12288, 66, 96, 49152, 14),
}


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens with one strided conv (the standard ViT stem)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, H/p * W/p, D)."""
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention on SDPA so the fused/flash kernels are used when available."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        # Shapes from the head count and size the module keeps (as timm's), not from the input width: a strategy
        # that splits the heads over ranks (tensor parallelism) sets `num_heads` to this rank's share.
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class Mlp(nn.Module):
    """Two-layer GELU MLP of the transformer block."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): in training, drop a residual branch for a random ``p`` of the samples
    and scale the kept ones by ``1 / (1 - p)``; the identity in eval mode. No parameters: state dicts unchanged."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop-path rate {p} must be in [0, 1)")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class Block(nn.Module):
    """Pre-norm transformer block; the unit the strategy shards and checkpoints."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, drop_path: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, mlp_dim)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def drop_path_rates(depth: int, drop_path_rate: float) -> list[float]:
    """Each block's drop-path rate: linear from 0 at the first block to ``drop_path_rate`` at the last (timm's
    and DeiT's rule)."""
    return [drop_path_rate * (i / (depth - 1)) for i in range(depth)] if depth > 1 else [drop_path_rate] * depth


def make_blocks(dim: int, depth: int, num_heads: int, mlp_dim: int, drop_path_rate: float = 0.0) -> nn.ModuleList:
    """A stack of identical ``Block`` s: one class, one ModuleList, so it is auto-detected; drop-path by
    ``drop_path_rates``."""
    return nn.ModuleList(Block(dim, num_heads, mlp_dim, rate) for rate in drop_path_rates(depth, drop_path_rate))


def init_vit_weights(module: nn.Module) -> None:
    """Truncated-normal linear init (as in the ViT papers); called via ``Module.apply``."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class ViTEncoder(nn.Module):
    """Patch embed + learned position embedding + blocks; returns all tokens (no class token).

    Shared by the classifier (mean-pool), the detector (reshape to a feature map) and the video model.
    """

    def __init__(
        self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int, num_heads: int, mlp_dim: int
    ) -> None:
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} not divisible by patch_size {patch_size}")
        self.grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.pos_embed = nn.Parameter(torch.empty(1, self.grid * self.grid, embed_dim))
        self.blocks = make_blocks(embed_dim, depth, num_heads, mlp_dim)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.reset_parameters()
        self.apply(init_vit_weights)

    def reset_parameters(self) -> None:
        """Init this module's own parameters (lets a strategy re-init after meta-device materialisation)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> normalised tokens (B, grid*grid, D)."""
        x = self.patch_embed(x) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class VisionTransformer(nn.Module):
    """ViT classifier: class token + encoder blocks + linear head (the original ViT layout)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        mlp_dim: int | None = None,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} not divisible by patch_size {patch_size}")
        num_patches = (img_size // patch_size) ** 2
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.empty(1, num_patches + 1, embed_dim))
        self.blocks = make_blocks(embed_dim, depth, num_heads, mlp_dim or int(embed_dim * mlp_ratio), drop_path_rate)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        self.reset_parameters()
        self.apply(init_vit_weights)

    @classmethod
    def from_size(
        cls,
        size: str,
        img_size: int,
        in_chans: int,
        num_classes: int,
        patch_size: int | None = None,
        drop_path_rate: float = 0.0,
    ) -> VisionTransformer:
        """Build a named config from ``VIT_SIZES`` (patch size defaults to the published one)."""
        s = VIT_SIZES[size]
        return cls(
            img_size,
            patch_size or s.patch_size,
            in_chans,
            num_classes,
            s.embed_dim,
            s.depth,
            s.num_heads,
            mlp_dim=s.mlp_dim,
            drop_path_rate=drop_path_rate,
        )

    def reset_parameters(self) -> None:
        """Init this module's own parameters (lets a strategy re-init after meta-device materialisation)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> logits (B, num_classes)."""
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])
