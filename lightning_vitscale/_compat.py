"""Every private torch/Lightning import and version gate lives here, so upgrades touch one file."""

from __future__ import annotations

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from packaging.version import Version
from torch.distributed.tensor import DTensor

TORCH_VERSION = Version(torch.__version__.split("+")[0])
TORCH_GE_2_6 = TORCH_VERSION >= Version("2.6")

if TORCH_GE_2_6:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
else:  # pragma: no cover - pyproject requires torch>=2.6; kept to give a clear message on old installs
    raise ImportError(
        "lightning-vitscale needs torch>=2.6 for FSDP2 (`torch.distributed.fsdp.fully_shard`);"
        f" found {torch.__version__}. Upgrade torch: `pip install -U 'torch>=2.6'`."
    )

__all__ = [
    "DTensor",
    "FSDPModule",
    "METADATA_FILENAME",
    "MixedPrecisionPolicy",
    "ModelParallelStrategy",
    "TORCH_VERSION",
    "fully_shard",
]

METADATA_FILENAME = _METADATA_FILENAME
