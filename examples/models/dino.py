"""DINO networks and loss (Caron et al. 2021), plain single-device code: a multi-crop ViT, the projection head.

The student sees every crop, the teacher (same architecture, an exponential moving average of the student) only
the global ones; the loss makes the student predict the teacher's centred, sharpened distribution over
``out_dim`` prototypes for every other view of the image. Nothing here knows about sharding.
"""

from __future__ import annotations

import math
from itertools import groupby

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.models.vit import VIT_SIZES, VisionTransformer


class MultiCropViT(VisionTransformer):
    """ViT returning the class-token feature for any input size (the position table is resampled per size).

    Local crops are smaller than global ones; DINO interpolates the learned position embedding to the crop's
    patch grid, so one network serves both.
    """

    def __init__(self, size: str, img_size: int, in_chans: int, patch_size: int | None = None) -> None:
        s = VIT_SIZES[size]
        super().__init__(
            img_size, patch_size or s.patch_size, in_chans, 1, s.embed_dim, s.depth, s.num_heads, mlp_dim=s.mlp_dim
        )
        self.head = nn.Identity()  # features, not logits
        self.embed_dim = s.embed_dim

    def _pos_embed(self, grid_h: int, grid_w: int) -> Tensor:
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        side = math.isqrt(patch_pos.shape[1])
        if (grid_h, grid_w) == (side, side):
            return self.pos_embed
        table = patch_pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        table = F.interpolate(table, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        return torch.cat([cls_pos, table.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> normalised class-token features (B, D)."""
        tokens = self.patch_embed.proj(x)
        grid_h, grid_w = tokens.shape[-2:]
        tokens = tokens.flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), tokens], dim=1) + self._pos_embed(grid_h, grid_w)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]


class DINOHead(nn.Module):
    """3-layer MLP -> L2-normalised bottleneck -> prototypes with unit-norm rows (DINO's weight-normed layer, g=1).

    ``use_bn`` puts a BatchNorm after each hidden layer (DINO's ``--use_bn_in_head``). It matters on small data:
    an untrained ViT's class tokens of different images are nearly parallel (mean cosine 0.99 on digits), so
    without it the teacher's output hardly varies across images, is uniform after centring, and the pair
    collapses; the BatchNorm rescales the per-image differences to unit variance from the first step.
    """

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, bottleneck_dim: int, use_bn: bool = False) -> None:
        super().__init__()

        def norm() -> nn.Module:
            return nn.BatchNorm1d(hidden_dim) if use_bn else nn.Identity()

        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            norm(),
            nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim),
            norm(),
            nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim),
        )
        self.prototypes = nn.Linear(bottleneck_dim, out_dim, bias=False)
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, F.normalize(self.prototypes.weight, dim=-1))


class DINONet(nn.Module):
    """Backbone + head; crops of the same resolution go through the backbone in one call (as DINO batches them)."""

    def __init__(self, backbone: MultiCropViT, head: DINOHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, crops: list[Tensor]) -> Tensor:
        """Crops (each (B, C, h, w), same-size crops adjacent) -> head outputs (len(crops) * B, out_dim), in order."""
        feats = [self.backbone(torch.cat(list(same))) for _, same in groupby(crops, key=lambda c: c.shape[-2:])]
        return self.head(torch.cat(feats))


def dino_loss(
    student: Tensor, teacher: Tensor, center: Tensor, n_crops: int, student_temp: float, teacher_temp: float
) -> Tensor:
    """Cross-entropy between the teacher's centred, sharpened global views and the student's other views.

    ``student``: (n_crops * B, K), global crops first; ``teacher``: (n_global * B, K). A view is never compared
    with itself, so with 2 global and L local crops each image gives 2 * (1 + L) terms, averaged.
    """
    log_p = F.log_softmax(student / student_temp, dim=-1).chunk(n_crops)
    q = F.softmax((teacher - center) / teacher_temp, dim=-1).chunk(teacher.shape[0] // log_p[0].shape[0])
    terms = [(-qi * lp).sum(-1).mean() for i, qi in enumerate(q) for v, lp in enumerate(log_p) if v != i]
    return torch.stack(terms).mean()


def knn_predict(
    query: Tensor, bank: Tensor, bank_labels: Tensor, num_classes: int, k: int = 20, temperature: float = 0.07
) -> Tensor:
    """Weighted k-NN vote on cosine similarity (DINO's evaluation): class scores (B, num_classes)."""
    sim = F.normalize(query, dim=-1) @ F.normalize(bank, dim=-1).T
    top_sim, top_idx = sim.topk(min(k, bank.shape[0]), dim=-1)
    votes = F.one_hot(bank_labels[top_idx], num_classes).to(query.dtype)
    return (votes * (top_sim / temperature).exp().unsqueeze(-1)).sum(1)
