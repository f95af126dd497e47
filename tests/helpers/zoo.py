"""A zoo of transformer block families, each a tiny image classifier (8x8 images, width 16-32, 2 blocks), built
without downloads: timm, Hugging Face transformers, torchvision and torch constructors with random init, and
hand-written layouts people copy (lucidrains' ``ModuleList([attention, feed-forward])`` iterated by its parent,
attention calling ``F.linear`` on a module's weight, a per-head relative position bias table, head counts kept as
``heads`` / ``n_heads`` / ``nhead``, read from the shapes or kept under a name no plan knows, 1x1-convolution
projections).

``FAMILIES``: name -> builder of a module mapping ``(N, 3, 8, 8)`` images to ``(N, 10)`` logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

IMAGE, PATCH, CLASSES = 8, 4, 10
TOKENS = (IMAGE // PATCH) ** 2


class PatchClassifier(nn.Module):
    """Patch embedding, ``layers`` (called by ``run``), a final norm and a head: the hand-written families' frame."""

    def __init__(self, dim: int, layers: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, PATCH, PATCH)
        self.pos = nn.Parameter(torch.randn(1, TOKENS, dim) * 0.02)
        self.layers = layers
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.run(x)).mean(1))


# lucidrains/vit-pytorch's layout (einops written out): the layer is a ModuleList the parent iterates.
class LucidAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 4, dim_head: int = 8) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head**-0.5
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, -1))
        attn = (torch.matmul(q, k.transpose(-1, -2)) * self.scale).softmax(-1)
        return self.to_out(torch.matmul(attn, v).transpose(1, 2).reshape(b, n, -1))


class LucidFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0),
                                 nn.Linear(hidden, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LucidViT(PatchClassifier):
    """``for attn, ff in self.layers: x = attn(x) + x; x = ff(x) + x``; ``container``: what holds a layer
    (``nn.ModuleList`` as lucidrains writes it, or ``nn.Sequential``, whose own forward is never called either)."""

    def __init__(self, dim: int = 32, depth: int = 2, container: type[nn.Module] = nn.ModuleList) -> None:
        pair = lambda: [LucidAttention(dim), LucidFeedForward(dim, 2 * dim)]  # noqa: E731
        layers = [container(*pair()) if container is nn.Sequential else container(pair()) for _ in range(depth)]
        super().__init__(dim, nn.ModuleList(layers))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return x


class Block(nn.Module):
    """A pre-norm block around ``attn`` with an MLP of ``fc1``, ``fc2``."""

    def __init__(self, dim: int, attn: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), attn, nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class FunctionalAttention(nn.Module):
    """Projections applied with ``F.linear`` on the modules' weights (as timm's BEiT or torchvision's Swin do)."""

    def __init__(self, dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(*qkv.unbind(0)).transpose(1, 2).reshape(b, n, -1)
        return F.linear(out, self.proj.weight, self.proj.bias)


class BiasTableAttention(nn.Module):
    """A learned relative position bias per head (a table indexed by token offsets), head count as ``n_heads``."""

    def __init__(self, dim: int, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.randn(2 * TOKENS - 1, n_heads) * 0.02)
        offsets = torch.arange(TOKENS)[:, None] - torch.arange(TOKENS)[None, :] + TOKENS - 1
        self.register_buffer("index", offsets, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.table[self.index].permute(2, 0, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class SeparateQKV(nn.Module):
    """Separate q, k, v projections and an output one; head count as ``nhead``."""

    def __init__(self, dim: int, nhead: int = 4) -> None:
        super().__init__()
        self.nhead = nhead
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).reshape(b, n, self.nhead, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class HeadSizeAttention(nn.Module):
    """No head count: the heads are read from the shapes (``reshape(..., -1, head_dim)``), or from an attribute of a
    name no plan knows (``per_rank_heads=False``: ``self.h``, which splitting does not change)."""

    def __init__(self, dim: int, per_rank_heads: bool = True) -> None:
        super().__init__()
        self.head_dim, self.h, self.per_rank_heads = 8, dim // 8, per_rank_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        heads, size = (-1, self.head_dim) if self.per_rank_heads else (self.h, -1)
        q, k, v = self.qkv(x).reshape(b, n, 3, heads, size).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class ConvAttention(nn.Module):
    """Projections as 1x1 convolutions over the tokens: a head count, but no Linear the plan could split."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Conv1d(dim, 3 * dim, 1), nn.Conv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x.transpose(1, 2)).transpose(1, 2).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(*qkv.unbind(0)).transpose(1, 2).reshape(b, n, -1)
        return self.proj(out.transpose(1, 2)).transpose(1, 2)


def hand_written(attention: Callable[[int], nn.Module], dim: int = 32) -> nn.Module:
    return PatchClassifier(dim, nn.Sequential(*(Block(dim, attention(dim)) for _ in range(2))))


class SharedBlockViT(PatchClassifier):
    """ALBERT's layout in a ViT: one ``Block`` whose weights every layer shares, called ``depth`` times per forward
    (one module, so nothing repeats in the model's structure); ``listed``: held ``depth`` times in a ``ModuleList``
    (the same module each time: ``named_children`` lists it once)."""

    def __init__(self, dim: int = 32, depth: int = 4, listed: bool = False) -> None:
        block = Block(dim, nn.Identity())
        super().__init__(dim, nn.ModuleList([block] * depth) if listed else block)
        self.depth = depth

    def run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers if isinstance(self.layers, nn.ModuleList) else [self.layers] * self.depth:
            x = layer(x)
        return x


class TwoPassViT(PatchClassifier):
    """DINO's multi-crop in miniature: every block runs twice a step, on all tokens and then on the first half of
    them (a crop), each pass's features classified."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__(dim, nn.Sequential(*[Block(dim, nn.Identity()) for _ in range(depth)]))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.layers(x), self.layers(x[:, : x.shape[1] // 2])], dim=1)


class SelfCheckpointedViT(PatchClassifier):
    """A forward that checkpoints its own blocks while training, as Swin's reference code and many older repositories
    do: ``"reentrant"``, ``checkpoint(blk, x, use_reentrant=True)`` (the old default: each block runs without
    gradients first, again in backward); ``"non_reentrant"``; ``"sequential"``, ``checkpoint_sequential`` over the
    blocks in 2 reentrant segments (the last runs as usual)."""

    def __init__(self, how: str, dim: int = 32, depth: int = 4) -> None:
        super().__init__(dim, nn.ModuleList([Block(dim, FunctionalAttention(dim)) for _ in range(depth)]))
        self.how = how

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.layers(x) if isinstance(self.layers, nn.Sequential) else _each(self.layers, x)
        if self.how == "sequential":
            return checkpoint_sequential(self.layers, 2, x, use_reentrant=True)
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return x


def _each(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SoftMoEBlock(nn.Module):
    """A transformer block whose MLP is a soft mixture of experts (Puigcerver et al.'s Soft MoE in miniature): every
    expert runs on the normed tokens, their outputs weighted by a router. The experts hold most of the block's
    parameters and repeat inside it, but run side by side: the block is the unit, not each expert."""

    def __init__(self, dim: int, experts: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x)
        weights = self.router(h).softmax(-1)
        return x + sum(expert(h) * weights[..., i : i + 1] for i, expert in enumerate(self.experts))


class SoftMoEViT(PatchClassifier):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__(dim, nn.Sequential(*[SoftMoEBlock(dim) for _ in range(depth)]))


class Logits(nn.Module):
    """A library model whose forward returns a ModelOutput or a tensor: logits either way."""

    def __init__(self, model: nn.Module, keyword: str | None = None) -> None:
        super().__init__()
        self.model, self.keyword = model, keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(**{self.keyword: x}) if self.keyword else self.model(x)
        return out if isinstance(out, torch.Tensor) else out.logits


def timm_vit() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=IMAGE, patch_size=PATCH, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2,
                             num_classes=CLASSES, init_values=0.1, qk_norm=True)


def timm_beit() -> nn.Module:
    from timm.models.beit import Beit

    return Beit(img_size=IMAGE, patch_size=PATCH, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2,
                num_classes=CLASSES, use_rel_pos_bias=True, init_values=0.1)


def timm_swin() -> nn.Module:
    from timm.models.swin_transformer import SwinTransformer

    return SwinTransformer(img_size=IMAGE, patch_size=2, window_size=2, embed_dim=16, depths=(2,), num_heads=(4,),
                           num_classes=CLASSES)


def torchvision_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=IMAGE, patch_size=PATCH, num_layers=2, num_heads=4, hidden_dim=32,
                             mlp_dim=64, num_classes=CLASSES)


def torchvision_swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[2], num_heads=[4], window_size=[2, 2],
                           num_classes=CLASSES)


def hf(config_name: str, model_name: str, **config) -> nn.Module:
    import transformers

    made = getattr(transformers, config_name)(image_size=IMAGE, num_labels=CLASSES, **config)
    return Logits(getattr(transformers, model_name)(made), "pixel_values")


HF_VIT = {"patch_size": PATCH, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def hf_swin() -> nn.Module:
    return hf("SwinConfig", "SwinForImageClassification", patch_size=2, embed_dim=16, depths=[2], num_heads=[4],
              window_size=2)


def torch_encoder(dim: int = 32) -> nn.Module:
    """``nn.TransformerEncoderLayer`` x2 (``nn.MultiheadAttention`` inside)."""
    layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
    return PatchClassifier(dim, nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


class HFClip(nn.Module):
    """HF CLIP's vision tower (``CLIPEncoderLayer``: separate q, k, v, out projections) with a linear head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import CLIPVisionConfig, CLIPVisionModel

        config = CLIPVisionConfig(image_size=IMAGE, patch_size=PATCH, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64)
        self.tower, self.head = CLIPVisionModel(config), nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tower(pixel_values=x).pooler_output)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "lucid_modulelist": LucidViT,
    "functional_linear": lambda: hand_written(FunctionalAttention),
    "bias_table": lambda: hand_written(BiasTableAttention),
    "separate_qkv_nhead": lambda: hand_written(SeparateQKV),
    "conv_attention": lambda: hand_written(ConvAttention),
    "heads_from_shapes": lambda: hand_written(HeadSizeAttention),
    "unknown_head_attribute": lambda: hand_written(lambda dim: HeadSizeAttention(dim, per_rank_heads=False)),
    "timm_vit": timm_vit,
    "timm_beit": timm_beit,
    "timm_swin": timm_swin,
    "torchvision_vit": torchvision_vit,
    "torchvision_swin": torchvision_swin,
    "torch_encoder": torch_encoder,
    "hf_beit": lambda: hf("BeitConfig", "BeitForImageClassification", **HF_VIT, use_relative_position_bias=True,
                          layer_scale_init_value=0.1),
    "hf_swin": hf_swin,
    "hf_clip": HFClip,
}


def torchvision_maxvit() -> nn.Module:
    """MaxViT: each layer an MBConv, window attention and grid attention in one ``Sequential``."""
    from torchvision.models.maxvit import MaxVit

    return MaxVit(input_size=(IMAGE, IMAGE), stem_channels=8, partition_size=2, block_channels=[16], block_layers=[2],
                  head_dim=8, stochastic_depth_prob=0.0, num_classes=CLASSES)


def torchvision_efficientnet() -> nn.Module:
    """EfficientNet: each MBConv's convolutions and squeeze-excitation in one ``Sequential``."""
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    stages = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(4, 3, 2, 8, 16, 2), MBConvConfig(4, 3, 1, 16, 16, 2)]
    return EfficientNet(stages, dropout=0.0, stochastic_depth_prob=0.0, num_classes=CLASSES, last_channel=32)


def hf_resnet() -> nn.Module:
    """HF's ResNet: each bottleneck's three alike conv layers (1x1 down, 3x3, 1x1 up) in one ``Sequential``."""
    return hf("ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[16, 32], depths=[2, 2],
              layer_type="bottleneck")


class GoogLeNetLogits(nn.Module):
    """torchvision's GoogLeNet on 32-pixel images (its five poolings need them): each Inception block's branches are
    a lone convolution, two alike ``Sequential`` s of two convolutions and a pooling branch."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models import googlenet

        self.net = googlenet(aux_logits=False, init_weights=False, num_classes=CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(F.interpolate(x, size=32))


# Blocks made of repeated parts of another kind beside each other (the convolutions of an MBConv, a MaxViT layer's
# two attentions beside its MBConv), or of alike parts of changing widths (a bottleneck's): the block is the unit,
# never its parts. Each with the blocks found.
PARTS: dict[str, tuple[Callable[[], nn.Module], dict[str, int]]] = {
    "torchvision_maxvit": (torchvision_maxvit, {"MaxVitLayer": 2}),
    "torchvision_efficientnet": (torchvision_efficientnet, {"Conv2dNormActivation": 2, "MBConv": 4}),
    "hf_resnet": (hf_resnet, {"ResNetBottleNeckLayer": 4}),
    "torchvision_googlenet": (GoogLeNetLogits, {"BasicConv2d": 3, "Inception": 9}),
}


class Mask2FormerLogits(nn.Module):
    """HF's Mask2Former (a Swin backbone, a pixel decoder, a masked-attention decoder) as a classifier on 32-pixel
    images: its 1x1 input projections run once in the pixel decoder, its mask MLP's layers once per decoder layer,
    later, and its step cannot run on fake tensors alone (the decoder branches on a value, the loss matches with
    SciPy): it is measured on fake tensors carrying real values."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        swin = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
                                       num_heads=[1, 1, 2, 2], window_size=2,
                                       out_features=["stage1", "stage2", "stage3", "stage4"])
        config = transformers.Mask2FormerConfig(
            backbone_config=swin, feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=32,
            dim_feedforward=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2, num_queries=4,
            num_labels=CLASSES, use_pretrained_backbone=False, common_stride=4)
        self.model = transformers.Mask2FormerForUniversalSegmentation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=F.interpolate(x, size=32))
        return out.class_queries_logits.mean(1)[:, :CLASSES] + out.masks_queries_logits.mean((1, 2, 3))[:, None]


class DinoHeadViT(PatchClassifier):
    """Weight parametrizations as self-supervised ViTs use them: DINO's and DINOv2's head (an MLP, L2-normalized
    features, a last layer under the old hook-based ``torch.nn.utils.weight_norm`` with its norm ``weight_g`` frozen
    at 1), a spectral-normed layer in the head's MLP, and ``torch.nn.utils.parametrizations.weight_norm`` on every
    block's ``fc1`` (inside the units)."""

    def __init__(self, dim: int = 32, depth: int = 2) -> None:
        from torch.nn.utils import parametrizations

        blocks = [Block(dim, SeparateQKV(dim)) for _ in range(depth)]
        for block in blocks:
            block.fc1 = parametrizations.weight_norm(block.fc1)
        super().__init__(dim, nn.Sequential(*blocks))
        spectral = parametrizations.spectral_norm(nn.Linear(2 * dim, 16))
        self.head = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), spectral)
        self.last_layer = nn.utils.weight_norm(nn.Linear(16, CLASSES, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images).flatten(2).transpose(1, 2) + self.pos
        features = F.normalize(self.head(self.norm(self.run(x)).mean(1)), dim=-1)
        return self.last_layer(features) / 0.1


class GlobalFilter(nn.Module):
    """GFNet's token mixer (raoyongming/GFNet): a learned filter applied in the 2-d Fourier domain, its weight taken
    as complex numbers (``torch.view_as_complex``, which has no bf16 kernel), the input upcast on purpose."""

    def __init__(self, dim: int, side: int = IMAGE // PATCH) -> None:
        super().__init__()
        self.complex_weight = nn.Parameter(torch.randn(side, side // 2 + 1, dim, 2) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        side = int(n**0.5)
        x = torch.fft.rfft2(x.view(b, side, side, c).to(torch.float32), dim=(1, 2), norm="ortho")
        x = x * torch.view_as_complex(self.complex_weight)
        return torch.fft.irfft2(x, s=(side, side), dim=(1, 2), norm="ortho").reshape(b, n, c)


class AdaptiveFourierMixer(nn.Module):
    """FourCastNet's AFNO token mixer, one layer of block-diagonal complex weights: the spectrum of the input (upcast
    to fp32 on purpose) multiplied by its weights in an einsum, the output back in the input's dtype."""

    def __init__(self, dim: int, blocks: int = 2) -> None:
        super().__init__()
        self.blocks, self.size = blocks, dim // blocks
        self.w1 = nn.Parameter(0.02 * torch.randn(2, blocks, self.size, self.size))
        self.b1 = nn.Parameter(0.02 * torch.randn(2, blocks, self.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, (b, n, c) = x.dtype, x.shape
        side = int(n**0.5)
        z = torch.fft.rfft2(x.float().reshape(b, side, side, c), dim=(1, 2), norm="ortho")
        z = z.reshape(b, side, side // 2 + 1, self.blocks, self.size)
        mix = lambda a, w: torch.einsum("...bi,bio->...bo", a, w)  # noqa: E731
        real = F.relu(mix(z.real, self.w1[0]) - mix(z.imag, self.w1[1]) + self.b1[0])
        imag = F.relu(mix(z.imag, self.w1[0]) + mix(z.real, self.w1[1]) + self.b1[1])
        z = torch.view_as_complex(torch.stack([real, imag], dim=-1)).reshape(b, side, side // 2 + 1, c)
        return torch.fft.irfft2(z, s=(side, side), dim=(1, 2), norm="ortho").reshape(b, n, c).type(dtype) + x


class FourierBlock(nn.Module):
    """GFNet's block: a norm, the Fourier token mixer, a norm and an MLP."""

    def __init__(self, dim: int, mixer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.norm1, self.filter, self.norm2 = nn.LayerNorm(dim), mixer(dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm2(self.filter(self.norm1(x))))


class SpectralConv2d(nn.Module):
    """The Fourier neural operator's layer as its reference code writes it (neuraloperator's ``fourier_2d.py``): the
    lowest ``modes`` frequencies of each channel mixed by complex weights (``torch.cfloat`` parameters)."""

    def __init__(self, channels: int, modes: int = 2) -> None:
        super().__init__()
        scale = 1 / (channels * channels)
        self.modes = modes
        self.weights1 = nn.Parameter(scale * torch.rand(channels, channels, modes, modes, dtype=torch.cfloat))
        self.weights2 = nn.Parameter(scale * torch.rand(channels, channels, modes, modes, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, (h, w) = self.modes, x.shape[-2:]
        x_ft = torch.fft.rfft2(x)
        out = torch.zeros(x.shape[0], self.weights1.shape[1], h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.weights1)
        out[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], self.weights2)
        return torch.fft.irfft2(out, s=(h, w))


class FourierOperator(nn.Module):
    """An FNO as an image classifier: a lifting convolution, blocks of a spectral convolution beside a 1x1 one."""

    def __init__(self, channels: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.lift = nn.Conv2d(3, channels, 1)
        self.spectral = nn.ModuleList(SpectralConv2d(channels) for _ in range(depth))
        self.pointwise = nn.ModuleList(nn.Conv2d(channels, channels, 1) for _ in range(depth))
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lift(x)
        for spectral, pointwise in zip(self.spectral, self.pointwise):
            x = F.gelu(spectral(x) + pointwise(x))
        return self.head(x.mean((2, 3)))


# Token mixers computing with their weights in the Fourier domain (GFNet, FourCastNet's AFNO): their own code needs
# fp32 weights, as DDP's AMP keeps them.
FOURIER: dict[str, Callable[[], nn.Module]] = {
    "gfnet": lambda: PatchClassifier(32, nn.Sequential(*(FourierBlock(32, GlobalFilter) for _ in range(2)))),
    "afno": lambda: PatchClassifier(32, nn.Sequential(*(FourierBlock(32, AdaptiveFourierMixer) for _ in range(2)))),
}


# Blocks of different containers that run apart (one of them many times a forward): never one unit.
APART: dict[str, Callable[[], nn.Module]] = {"hf_mask2former": Mask2FormerLogits}


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class TopDown(PatchClassifier):
    """An encoder stack, then a decoder stack run last block first (as a top-down pathway runs: HF UperNet's head):
    in the step's order the decoder's blocks run back to back, last first, after the encoder's."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__(dim, nn.ModuleList([Residual(dim) for _ in range(depth)]))
        self.decoder = nn.ModuleList([Residual(dim) for _ in range(depth)])

    def run(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        for block in reversed(self.decoder):
            x = block(x)
        return x


def hf_poolformer() -> nn.Module:
    """HF's PoolFormer: each stage's patch embedding (in one ``ModuleList``), then its layers (in another), stage after
    stage: both repeat, so both are blocks, called interleaved."""
    import transformers

    config = transformers.PoolFormerConfig(hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 2, 2], num_labels=CLASSES)
    return Logits(transformers.PoolFormerForImageClassification(config), "pixel_values")


# Blocks the step calls in another order than the model lists them.
INTERLEAVED: dict[str, Callable[[], nn.Module]] = {"top_down": TopDown, "hf_poolformer": hf_poolformer}
