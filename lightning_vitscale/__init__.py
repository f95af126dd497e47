"""lightning-vitscale: scale any Lightning vision model from one GPU to a cluster with one argument."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_vitscale.averaging import ShardedEMA
from lightning_vitscale.checkpoint import (
    AsyncSaveError,
    CheckpointError,
    StateDictGatherError,
    consolidate_checkpoint,
    consolidated,
)
from lightning_vitscale.checkpoint.lightning import VitScaleCheckpointIO
from lightning_vitscale.discovery import find_blocks
from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.memory import MemoryPlan, StateBytes, measure_state_bytes, plan_memory
from lightning_vitscale.monitoring import VitScaleThroughput
from lightning_vitscale.precision import NonFiniteTrainingError, VitScalePrecision, grad_norm
from lightning_vitscale.sharding import (
    BackwardOutsideManualBackwardError,
    InStepCallError,
    MixedTensorsError,
    NoBlocksMatchedError,
    OutsideStepCallError,
    ParameterWriteError,
    SecondBackwardError,
    SetupSummary,
    ShardedModuleReuseError,
    SkippedBlocksError,
)
from lightning_vitscale.strategy import VitScaleStrategy

# Lightning's public registry of strategy names: `Trainer(strategy="vitscale")`. The import changes nothing else of
# Lightning (tests/unit/checkpoint/test_import_side_effects.py).
if VitScaleStrategy.strategy_name not in StrategyRegistry:
    VitScaleStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (setuptools dynamic version)

__all__ = [
    "AsyncSaveError",
    "BackwardOutsideManualBackwardError",
    "CheckpointError",
    "InStepCallError",
    "KernelPolicy",
    "MemoryPlan",
    "MixedTensorsError",
    "NoBlocksMatchedError",
    "NonFiniteTrainingError",
    "OutsideStepCallError",
    "ParameterWriteError",
    "SecondBackwardError",
    "SetupSummary",
    "ShardedEMA",
    "ShardedModuleReuseError",
    "SkippedBlocksError",
    "StateBytes",
    "StateDictGatherError",
    "VitScaleCheckpointIO",
    "VitScalePrecision",
    "VitScaleStrategy",
    "VitScaleThroughput",
    "consolidate_checkpoint",
    "consolidated",
    "find_blocks",
    "grad_norm",
    "measure_state_bytes",
    "plan_memory",
]

