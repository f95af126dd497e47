"""Factorised space-time video ViT (ViViT "factorised self-attention", Arnab et al. 2021), plain PyTorch.

Tubelets are embedded with one Conv3d; each layer then runs a spatial ``Block`` over the tokens of
one time step and a temporal ``Block`` over the tokens of one location. Attention cost is
O(T*S^2 + S*T^2) instead of O((S*T)^2), and both stacks are ``nn.ModuleList`` s of the same
``Block`` class, so the strategy finds and shards them like any ViT.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from examples.models.vit import VIT_SIZES, init_vit_weights, make_blocks


class FactorisedVideoViT(nn.Module):
    """Video (B, T, C, H, W) -> logits via alternating spatial / temporal attention, mean-pooled."""

    def __init__(
        self,
        size: str,
        img_size: int,
        num_frames: int,
        in_chans: int,
        num_classes: int,
        patch_size: int | None = None,
        tubelet: int = 2,
    ) -> None:
        super().__init__()
        s = VIT_SIZES[size]
        patch = patch_size or s.patch_size
        if img_size % patch or num_frames % tubelet:
            raise ValueError(f"img_size {img_size}/num_frames {num_frames} not divisible by {patch}/{tubelet}")
        d = s.embed_dim
        self.t_tokens, self.s_tokens = num_frames // tubelet, (img_size // patch) ** 2
        self.embed = nn.Conv3d(in_chans, d, kernel_size=(tubelet, patch, patch), stride=(tubelet, patch, patch))
        self.space_pos = nn.Parameter(torch.empty(1, 1, self.s_tokens, d))
        self.time_pos = nn.Parameter(torch.empty(1, self.t_tokens, 1, d))
        self.space_blocks = make_blocks(d, s.depth, s.num_heads, s.mlp_dim)
        self.time_blocks = make_blocks(d, s.depth, s.num_heads, s.mlp_dim)
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, num_classes)
        self.reset_parameters()
        self.apply(init_vit_weights)

    def reset_parameters(self) -> None:
        """Init this module's own parameters (lets a strategy re-init after meta-device materialisation)."""
        nn.init.trunc_normal_(self.space_pos, std=0.02)
        nn.init.trunc_normal_(self.time_pos, std=0.02)

    def forward(self, video: Tensor) -> Tensor:
        b, t, s = video.shape[0], self.t_tokens, self.s_tokens
        x = self.embed(video.transpose(1, 2))  # (B, D, T', H', W')
        x = x.flatten(3).permute(0, 2, 3, 1) + self.space_pos + self.time_pos  # (B, T', S, D)
        d = x.shape[-1]
        for space, time in zip(self.space_blocks, self.time_blocks):
            x = space(x.reshape(b * t, s, d)).view(b, t, s, d)
            x = time(x.transpose(1, 2).reshape(b * s, t, d)).view(b, s, t, d).transpose(1, 2)
        return self.head(self.norm(x.mean(dim=(1, 2))))


class MViTv2S(nn.Module):
    """torchvision's MViTv2-S (Li et al. 2022; ``torchvision.models.video.mvit_v2_s``) at any clip size.

    ``mvit_v2_s()`` fixes the clip to 16 x 224 x 224; this builds torchvision's own ``MViT`` class with the
    same 16-block configuration (checked against ``mvit_v2_s`` by the tests) for ``num_frames`` x ``img_size``,
    which must survive the stem (stride 2 x 4 x 4) and three 2x spatial poolings: ``img_size`` a multiple of
    32, ``num_frames`` even. Takes (B, T, C, H, W) clips like the factorised ViT; its ``MultiscaleBlock`` s
    are what the strategy shards. No pretrained weights (no downloads at run time).
    """

    def __init__(
        self, img_size: int, num_frames: int, num_classes: int, dropout: float = 0.5, stochastic_depth: float = 0.2
    ) -> None:
        super().__init__()
        from torchvision.models.video import MViT

        if img_size % 32 or num_frames % 2:
            raise ValueError(f"mvit_v2_s needs img_size % 32 == 0 and an even num_frames, got {img_size}/{num_frames}")
        self.net = MViT(
            spatial_size=(img_size, img_size),
            temporal_size=num_frames,
            block_setting=mvit_v2_s_blocks(),
            residual_pool=True,
            residual_with_cls_embed=False,
            rel_pos_embed=True,
            proj_after_attn=True,
            dropout=dropout,
            stochastic_depth_prob=stochastic_depth,
            num_classes=num_classes,
        )

    def forward(self, video: Tensor) -> Tensor:
        return self.net(video.transpose(1, 2))  # MViT takes (B, C, T, H, W)


def mvit_v2_s_blocks() -> list:
    """The block table of torchvision's ``mvit_v2_s``: 16 blocks, q pooling at 1, 3 and 14, kv stride 8 -> 1."""
    from torchvision.models.video.mvit import MSBlockConfig

    heads = [1, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 8]
    chans = [96, 96, 192, 192] + [384] * 11 + [768, 768]  # block i maps chans[i] -> chans[i + 1]
    kv = [8, 4, 4] + [2] * 11 + [1, 1]
    return [
        MSBlockConfig(
            num_heads=heads[i],
            input_channels=chans[i],
            output_channels=chans[i + 1],
            kernel_q=[3, 3, 3],
            kernel_kv=[3, 3, 3],
            stride_q=[1, 2, 2] if i in (1, 3, 14) else [1, 1, 1],
            stride_kv=[1, kv[i], kv[i]],
        )
        for i in range(16)
    ]
