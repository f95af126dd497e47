"""Which modules are normalization layers: torch's, their subclasses and third-party ones that do not subclass them.

The recipe keeps exactly these in fp32 (precision/), so detection must catch HF/timm norms too.
"""

from __future__ import annotations

import re

from torch import nn

from lightning_vitscale._compat import BatchNormBase, InstanceNormBase

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    BatchNormBase,
    InstanceNormBase,
)
_NORM_FUNCTIONS = frozenset({"layer_norm", "group_norm", "rms_norm", "batch_norm", "instance_norm"})
_NORM_NAME = re.compile(r"(Layer|Group|RMS|Rms|Batch|Instance)Norm")


def is_normalization(name: str, module: nn.Module) -> bool:
    """A torch norm, a module whose own ``forward`` calls a norm functional (``F.layer_norm``, ...), or one named
    like a norm (HF/timm ``...RMSNorm``, ``LayerNorm2d``), holding its parameters itself (not a block of norms)."""
    if any(True for _ in (p for child in module.children() for p in child.parameters())):
        return False
    if isinstance(module, _NORM_TYPES):
        return True
    if not _scales_channels(module):
        return False
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and _NORM_FUNCTIONS & set(code.co_names):
        return True
    return bool(_NORM_NAME.search(type(module).__name__))


def _scales_channels(module: nn.Module) -> bool:
    """A norm's own parameters scale and shift channels: each has at most one dimension above 1 (``(C,)``,
    ``(1, C, 1, 1)``). A convolution that standardizes its *weight* (timm's ``StdConv2d``/``ScaledStdConv2d`` in BiT,
    NFNet and the R50+ViT hybrids, HF's ``WeightStandardizedConv2d``) calls ``F.batch_norm`` too, on a weight of
    several such dimensions: it is a convolution, to be sharded and computed in bf16 like the others (taken for a
    norm, every convolution of an NFNet was kept fp32 and replicated on every rank)."""
    return all(sum(size > 1 for size in p.shape) <= 1 for p in module.parameters(recurse=False))
