"""Tensor-core friendliness: name every matrix dimension that is not a multiple of 8 (tensor-core tiles)."""

from __future__ import annotations

import math

from torch import nn

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def tensor_core_report(model: nn.Module, multiple: int = 8) -> list[str]:
    """One line per Linear/Conv/attention dimension of ``model`` that is not a multiple of ``multiple`` (tensor
    cores and flash attention run those at full speed), e.g. ``"1: Linear out_features=10 (not a multiple of 8)"``;
    reads only module attributes, so meta models work too."""
    if multiple < 1:
        raise ValueError(f"`multiple` must be >= 1; got {multiple}.")
    lines = []
    for name, module in model.named_modules():
        label = f"{name or type(model).__name__}: {type(module).__name__}"
        for attr, value in _dimensions(module):
            if value % multiple:
                lines.append(f"{label} {attr}={value} (not a multiple of {multiple})")
    return lines


def _dimensions(module: nn.Module) -> list[tuple[str, int]]:
    """The GEMM-shaping sizes of one module (its children are visited on their own)."""
    if isinstance(module, nn.Linear):
        return [("in_features", module.in_features), ("out_features", module.out_features)]
    if isinstance(module, _CONVS):
        per_group_in = module.in_channels // module.groups
        # A conv is a GEMM whose reduction is (input channels per group) x (kernel area): an RGB patch embedding
        # (3 x 16 x 16 = 768) is fine although 3 is odd. Depthwise convs (one channel per group) are no GEMM.
        reduction = per_group_in * math.prod(module.kernel_size)
        dims = [("out_channels", module.out_channels)]
        depthwise = module.groups > 1 and per_group_in == 1
        return dims if depthwise else [*dims, ("in_channels*kernel_size", reduction)]
    if isinstance(module, nn.MultiheadAttention):
        return [("embed_dim", module.embed_dim), ("head_dim", module.embed_dim // module.num_heads)]
    return _head_dim(module)


def _head_dim(module: nn.Module) -> list[tuple[str, int]]:
    """Attention written by hand (timm ``Attention``, ``num_heads`` + ``head_dim``, or ``num_heads`` + ``qkv``)."""
    heads = getattr(module, "num_heads", None) or getattr(module, "heads", None)
    if not isinstance(heads, int) or heads < 1:
        return []
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int):
        return [("head_dim", head_dim)]
    qkv = getattr(module, "qkv", None)
    if isinstance(qkv, nn.Linear) and qkv.out_features % (3 * heads) == 0:
        return [("head_dim", qkv.out_features // (3 * heads))]
    return []
