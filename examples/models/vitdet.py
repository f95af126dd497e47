"""ViTDet detector: ViTDet backbone -> simple feature pyramid -> shared anchor-free CenterNet head.

Following Li et al. 2022 (ViTDet), the pyramid is built only from the backbone's last feature map
(deconvs up, pooling down), so the backbone stays a plain stack of ``WindowBlock`` s (windowed attention,
a few global) that the strategy can shard; the head replaces the paper's Mask R-CNN. Each object is
assigned to one pyramid level by size (as in FCOS) and predicted there as a CenterNet peak + box size +
sub-cell offset.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.models.vit import VIT_SIZES
from examples.models.vitdet_backbone import ViTDetBackbone


def _conv_gn(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    """Conv + GroupNorm + GELU: batch-size independent, so fine for small per-device batches."""
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2), nn.GroupNorm(min(32, cout // 4), cout), nn.GELU())


class SimpleFeaturePyramid(nn.Module):
    """Multi-scale maps from one stride-``patch`` map: each output stride is ``patch * 2**k``."""

    def __init__(self, in_dim: int, out_dim: int, patch_size: int, strides: tuple[int, ...]) -> None:
        super().__init__()
        self.levels = nn.ModuleList()
        for s in strides:
            scale = math.log2(patch_size / s)  # >0: upsample, <0: downsample
            if scale != int(scale):
                raise ValueError(f"stride {s} not a power-of-two multiple of patch {patch_size}")
            layers: list[nn.Module] = []
            dim = in_dim
            for _ in range(int(scale)):
                layers += [nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), nn.GELU()]
                dim //= 2
            for _ in range(int(-scale)):
                layers.append(nn.MaxPool2d(2))
            layers += [_conv_gn(dim, out_dim, 1), _conv_gn(out_dim, out_dim)]
            self.levels.append(nn.Sequential(*layers))

    def forward(self, x: Tensor) -> list[Tensor]:
        return [level(x) for level in self.levels]


class CenterHead(nn.Module):
    """Shared per-level head: class heatmap logits, log box size (in strides), centre offset."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.tower = nn.Sequential(_conv_gn(dim, dim), _conv_gn(dim, dim))
        self.heat = nn.Conv2d(dim, num_classes, 1)
        self.box = nn.Conv2d(dim, 4, 1)  # (log w, log h, dx, dy)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        assert self.heat.bias is not None
        nn.init.constant_(self.heat.bias, -math.log((1 - 0.01) / 0.01))  # focal-loss prior: start near "no object"

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = self.tower(x)
        return self.heat(x), self.box(x)


class ViTDet(nn.Module):
    """Backbone + pyramid + head, with CenterNet target assignment, loss and decoding."""

    def __init__(
        self,
        size: str,
        img_size: int,
        patch_size: int | None,
        in_chans: int,
        num_classes: int,
        fpn_dim: int = 32,
        strides: tuple[int, ...] = (4, 8, 16),
        window_size: int = 14,
        global_blocks: tuple[int, ...] | None = None,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        s = VIT_SIZES[size]
        patch = patch_size or s.patch_size
        self.num_classes, self.strides = num_classes, strides
        self.backbone = ViTDetBackbone(
            img_size,
            patch,
            in_chans,
            s.embed_dim,
            s.depth,
            s.num_heads,
            s.mlp_dim,
            window_size,
            global_blocks,
            drop_path_rate,
        )
        self.pyramid = SimpleFeaturePyramid(s.embed_dim, fpn_dim, patch, strides)
        self.head = CenterHead(fpn_dim, num_classes)

    def forward(self, x: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Images (B, C, H, W) -> per level (heat logits (B, K, h, w), box (B, 4, h, w))."""
        return [self.head(f) for f in self.pyramid(self.backbone(x))]

    def _level_of(self, size: float) -> int:
        """FCOS-style scale assignment: object side in [2, 4) strides of a level (open-ended at the ends)."""
        for i, s in enumerate(self.strides[:-1]):
            if size < 4 * s:
                return i
        return len(self.strides) - 1

    def loss(self, outs: list[tuple[Tensor, Tensor]], targets: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """Penalty-reduced focal loss on Gaussian heatmaps + L1 on size/offset at object centres."""
        focal, reg, num_pos = (
            outs[0][0].new_zeros((), dtype=torch.float32),
            outs[0][0].new_zeros((), dtype=torch.float32),
            0,
        )
        for li, (heat, box) in enumerate(outs):
            heat, box = heat.float(), box.float()  # under bf16 autocast 1 - 1e-4 rounds to 1 -> log(0)
            stride = self.strides[li]
            b, k, h, w = heat.shape
            tgt = torch.zeros_like(heat)
            ys = torch.arange(h, device=heat.device, dtype=heat.dtype)[:, None] + 0.5
            xs = torch.arange(w, device=heat.device, dtype=heat.dtype)[None, :] + 0.5
            idx, box_t = [], []
            for bi, t in enumerate(targets):
                for (x0, y0, x1, y1), c in zip(t["boxes"].tolist(), t["labels"].tolist()):
                    if self._level_of(max(x1 - x0, y1 - y0)) != li:
                        continue
                    cx, cy = (x0 + x1) / 2 / stride, (y0 + y1) / 2 / stride
                    bw, bh = (x1 - x0) / stride, (y1 - y0) / stride
                    gx, gy = min(int(cx), w - 1), min(int(cy), h - 1)
                    sx, sy = max(bw / 6, 0.5), max(bh / 6, 0.5)
                    g = torch.exp(-((xs - cx) ** 2) / (2 * sx**2) - ((ys - cy) ** 2) / (2 * sy**2))
                    tgt[bi, c] = torch.maximum(tgt[bi, c], g)
                    tgt[bi, c, gy, gx] = 1.0
                    idx.append((bi, gy, gx))
                    box_t.append([math.log(bw), math.log(bh), cx - gx, cy - gy])
            p = heat.sigmoid().clamp(1e-4, 1 - 1e-4)
            pos = tgt.eq(1).to(p.dtype)
            focal = focal - (pos * (1 - p) ** 2 * p.log() + (1 - pos) * (1 - tgt) ** 4 * p**2 * (1 - p).log()).sum()
            if idx:
                ib, iy, ix = (torch.tensor(v, device=heat.device) for v in zip(*idx))
                pred = box[ib, :, iy, ix]  # (num_pos, 4)
                pred = torch.cat([pred[:, :2], pred[:, 2:].sigmoid()], dim=1)
                reg = reg + F.l1_loss(pred, torch.tensor(box_t, device=heat.device, dtype=heat.dtype), reduction="sum")
                num_pos += len(idx)
        n = max(num_pos, 1)
        return {"heat": focal / n, "box": reg / n}

    @torch.no_grad()
    def decode(self, outs: list[tuple[Tensor, Tensor]], top_k: int = 50) -> list[dict[str, Tensor]]:
        """Peaks (3x3 max-pool NMS) across all levels -> per-image xyxy boxes, scores, labels."""
        scores, labels, boxes = [], [], []
        img_h, img_w = outs[0][0].shape[-2] * self.strides[0], outs[0][0].shape[-1] * self.strides[0]
        for li, (heat, box) in enumerate(outs):
            stride = self.strides[li]
            b, k, h, w = heat.shape
            p = heat.float().sigmoid()
            p = p * (F.max_pool2d(p, 3, 1, 1) == p)
            gy, gx = torch.meshgrid(torch.arange(h, device=p.device), torch.arange(w, device=p.device), indexing="ij")
            bx = box.float()
            cx = (gx + bx[:, 2].sigmoid()) * stride
            cy = (gy + bx[:, 3].sigmoid()) * stride
            bw, bh = bx[:, 0].exp() * stride, bx[:, 1].exp() * stride
            xyxy = torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1)
            xyxy = torch.min(xyxy.clamp(min=0), xyxy.new_tensor([img_w, img_h, img_w, img_h]))
            scores.append(p.flatten(2).transpose(1, 2).reshape(b, -1))  # (B, h*w*K) ordered cell-major
            labels.append(torch.arange(k, device=p.device).repeat(h * w).expand(b, -1))
            boxes.append(xyxy.reshape(b, h * w, 1, 4).expand(-1, -1, k, -1).reshape(b, -1, 4))
        s, lab, bxs = torch.cat(scores, 1), torch.cat(labels, 1), torch.cat(boxes, 1)
        top, i = s.topk(min(top_k, s.shape[1]), dim=1)
        return [{"boxes": bxs[j, i[j]], "scores": top[j], "labels": lab[j, i[j]]} for j in range(s.shape[0])]
