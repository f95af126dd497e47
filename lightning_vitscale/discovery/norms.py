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
    """Normalization layers, including third-party ones that do not subclass torch's.

    A module counts if it is a torch norm, if its own ``forward`` calls a norm functional (``F.layer_norm``,
    ``F.group_norm``, ...), or if its class is named like one (HF/timm ``...RMSNorm``, ``LayerNorm2d``) — and
    it holds its parameters itself (a block that merely contains norms is not one).
    """
    if any(True for _ in (p for child in module.children() for p in child.parameters())):
        return False
    if isinstance(module, _NORM_TYPES):
        return True
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and _NORM_FUNCTIONS & set(code.co_names):
        return True
    return bool(_NORM_NAME.search(type(module).__name__))
