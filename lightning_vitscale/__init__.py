"""lightning-vitscale: scale any Lightning vision model from one GPU to a cluster with one argument."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_vitscale.averaging import ShardedEMA
from lightning_vitscale.checkpoint import (
    AsyncSaveError,
    CheckpointError,
    StateDictGatherError,
    consolidate_checkpoint,
    install_import_patches,
)
from lightning_vitscale.discovery import find_blocks
from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.memory import MemoryPlan, StateBytes, measure_state_bytes, plan_memory
from lightning_vitscale.monitoring import VitScaleThroughput
from lightning_vitscale.precision import NonFiniteTrainingError, VitScalePrecision
from lightning_vitscale.sharding import (
    NoBlocksMatchedError,
    OutsideStepCallError,
    SetupSummary,
    ShardedModuleReuseError,
)
from lightning_vitscale.strategy import VitScaleStrategy

if VitScaleStrategy.strategy_name not in StrategyRegistry:
    VitScaleStrategy.register_strategies(StrategyRegistry)
# The one change to Lightning at import (checkpoint/lightning/patches.py says what and why): its loaders read our
# sharded folders, and ckpt_path="last" finds their newest complete copy; every other path stays Lightning's.
install_import_patches()

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (setuptools dynamic version)

__all__ = [
    "AsyncSaveError",
    "CheckpointError",
    "KernelPolicy",
    "MemoryPlan",
    "NoBlocksMatchedError",
    "NonFiniteTrainingError",
    "OutsideStepCallError",
    "SetupSummary",
    "ShardedEMA",
    "ShardedModuleReuseError",
    "StateBytes",
    "StateDictGatherError",
    "VitScalePrecision",
    "VitScaleStrategy",
    "VitScaleThroughput",
    "consolidate_checkpoint",
    "find_blocks",
    "measure_state_bytes",
    "plan_memory",
]

