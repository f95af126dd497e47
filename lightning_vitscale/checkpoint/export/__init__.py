"""A checkpoint's weights as published files: one submodule's trained, EMA-averaged or DINO-teacher weights read
from a sharded folder, a ``.ckpt`` or a state-dict file (``weights.py``: :func:`read_weights`, the ``safetensors``
file) and written as an HF folder, a timm folder or a torchvision file, each checked against the model its own
library builds (``targets.py``). What ``python -m lightning_vitscale export`` and the examples' fine-tuning read.

May import the core checkpoint modules (the safe reader, consolidation) and ``_compat``; the core never imports it.
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
    Weights,
    WeightsChoice,
    read_weights,
    write_safetensors,
)

__all__ = [
    "EXPORT_DTYPES",
    "Weights",
    "WeightsChoice",
    "build_submodule",
    "parse_arch_args",
    "read_weights",
    "write_hf",
    "write_safetensors",
    "write_timm",
    "write_torchvision",
]
