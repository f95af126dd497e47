"""lightning-vitscale: scale any Lightning vision model from one GPU to a cluster with one argument."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_vitscale.checkpoint import CheckpointError, consolidate_checkpoint
from lightning_vitscale.checkpoint_loader import install_checkpoint_loader
from lightning_vitscale.ema import ShardedEMA
from lightning_vitscale.full_state_dict import StateDictGatherError
from lightning_vitscale.matching import find_blocks
from lightning_vitscale.memory import StateBytes, measure_state_bytes
from lightning_vitscale.parallelize import NoBlocksMatchedError
from lightning_vitscale.plan import ParallelPlan
from lightning_vitscale.planner import MemoryPlan, plan_memory
from lightning_vitscale.policies import KernelPolicy
from lightning_vitscale.precision import VitScalePrecision
from lightning_vitscale.reuse import ShardedModuleReuseError
from lightning_vitscale.root_unit import OutsideStepCallError
from lightning_vitscale.strategy import VitScaleStrategy
from lightning_vitscale.throughput import ThroughputMonitor, VitScaleThroughput

if VitScaleStrategy.strategy_name not in StrategyRegistry:
    VitScaleStrategy.register_strategies(StrategyRegistry)
install_checkpoint_loader()  # Lightning's load_from_checkpoint / DDP resume read our sharded folders

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (setuptools dynamic version)

__all__ = [
    "CheckpointError",
    "KernelPolicy",
    "MemoryPlan",
    "NoBlocksMatchedError",
    "OutsideStepCallError",
    "ParallelPlan",
    "ShardedEMA",
    "ShardedModuleReuseError",
    "StateDictGatherError",
    "StateBytes",
    "ThroughputMonitor",
    "VitScaleThroughput",
    "VitScalePrecision",
    "VitScaleStrategy",
    "consolidate_checkpoint",
    "find_blocks",
    "measure_state_bytes",
    "plan_memory",
]
