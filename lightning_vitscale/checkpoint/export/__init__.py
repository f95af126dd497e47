"""A checkpoint's weights as published files: one submodule's trained, EMA or DINO-teacher weights
(``weights.py``) as ``safetensors``, an HF folder, a timm folder or a torchvision file (``targets.py``).

May import the core checkpoint modules and ``_compat``; the core never imports it.
"""

from lightning_vitscale.checkpoint.export.targets import (
    build_submodule,
    parse_arch_args,
    write_hf,
    write_timm,
    write_torchvision,
)
from lightning_vitscale.checkpoint.export.weights import (
    EXPORT_DTYPES,
    WeightsChoice,
    read_weights,
    write_safetensors,
)

__all__ = [
    "EXPORT_DTYPES",
    "WeightsChoice",
    "build_submodule",
    "parse_arch_args",
    "read_weights",
    "write_hf",
    "write_safetensors",
    "write_timm",
    "write_torchvision",
]
