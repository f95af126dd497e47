"""Deprecated: import the settings from ``lightning_vitscale`` or the subpackage that owns each one.

``lightning_vitscale.policies`` gathered every concern's settings under one path; each now lives only with its
concern (``lightning_vitscale.sharding.ParallelConfig``, ``lightning_vitscale.kernels.KernelPolicy``, ...). This
module re-exports them for one release and warns on import; it will be removed in the next one.
"""

import warnings

from lightning_vitscale.averaging import EMAPolicy
from lightning_vitscale.checkpoint import CheckpointSettings, StateDictType
from lightning_vitscale.init import InitMode, InitSettings
from lightning_vitscale.kernels import KernelMode, KernelPolicy
from lightning_vitscale.precision import PrecisionFlag, PrecisionPolicy
from lightning_vitscale.sharding import (
    CheckpointingPolicy,
    CheckpointSelector,
    ModuleSelector,
    OffloadMode,
    ParallelConfig,
    ShardingLayout,
    ShardingPolicy,
)

warnings.warn(
    "`lightning_vitscale.policies` is deprecated and will be removed in the next release: import each setting from"
    " its subpackage (`from lightning_vitscale.sharding import ParallelConfig, ShardingPolicy, CheckpointingPolicy`,"
    " `from lightning_vitscale.kernels import KernelPolicy`, `from lightning_vitscale.precision import"
    " PrecisionPolicy`, `from lightning_vitscale.averaging import EMAPolicy`) or `KernelPolicy` from"
    " `lightning_vitscale`.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CheckpointSelector",
    "CheckpointSettings",
    "CheckpointingPolicy",
    "EMAPolicy",
    "InitMode",
    "InitSettings",
    "KernelMode",
    "KernelPolicy",
    "ModuleSelector",
    "OffloadMode",
    "ParallelConfig",
    "PrecisionFlag",
    "PrecisionPolicy",
    "ShardingLayout",
    "ShardingPolicy",
    "StateDictType",
]
