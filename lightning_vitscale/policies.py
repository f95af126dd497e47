"""The settings a strategy and its callbacks hold, under the path earlier releases documented for reading them
(``strategy.config``, ``strategy.precision_plugin.policy``, ``ShardedEMA(...).policy``).

Each is defined with its concern (``sharding/settings.py``, ``kernels/settings.py``, ...); this module only
gathers the public ones for users and owns nothing.
"""

from lightning_vitscale.averaging.settings import EMAPolicy
from lightning_vitscale.checkpoint.settings import CheckpointSettings, StateDictType
from lightning_vitscale.discovery import ModuleSelector
from lightning_vitscale.init.settings import InitMode, InitSettings
from lightning_vitscale.kernels.settings import KernelMode, KernelPolicy
from lightning_vitscale.precision.settings import PrecisionFlag, PrecisionPolicy
from lightning_vitscale.sharding.settings import (
    CheckpointingPolicy,
    CheckpointSelector,
    OffloadMode,
    ParallelConfig,
    ShardingLayout,
    ShardingPolicy,
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
