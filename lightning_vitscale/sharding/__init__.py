"""Sharding: what to wrap (settings) and what setup resolved it to (``resolved``), the ordered pipeline that applies
the recipe (``parallelize``) through its ``apply_*`` steps (``steps``; tensor-parallel plans proven first:
``tensor_proof``), the only ``fully_shard`` call site, activation checkpointing, the outer unit and calls outside a
step, the layout's traffic, and the strategy's whole setup sequence (``setup.shard_lightning_module``).

The top of the concerns: may import ``memory``, ``checkpoint``, ``precision``, ``kernels``, ``init``,
``discovery``, ``distributed``, ``_utils`` and ``_compat``; only the strategy and the CLI import it.
"""

from lightning_vitscale.discovery import ModuleSelector
from lightning_vitscale.discovery.tensor_plan import TensorPlanSelector
from lightning_vitscale.sharding.checkpointing_settings import CheckpointingPolicy, CheckpointSelector
from lightning_vitscale.sharding.gradients_of_gradients import naming_graph_inputs
from lightning_vitscale.sharding.mixed_tensors import MixedTensorsError, note_the_fix
from lightning_vitscale.sharding.outer_unit_errors import (
    BackwardOutsideManualBackwardError,
    InStepCallError,
    OutsideStepCallError,
    SecondBackwardError,
)
from lightning_vitscale.sharding.parallelize import NoBlocksMatchedError
from lightning_vitscale.sharding.parameter_writes import ParameterWriteError
from lightning_vitscale.sharding.resolved import ResolvedConfig, resolve_config
from lightning_vitscale.sharding.settings import (
    OffloadMode,
    ParallelConfig,
    Priority,
    ShardingLayout,
    ShardingPolicy,
    SkippedBlocks,
    shard_group_size,
)
from lightning_vitscale.sharding.setup import ShardedModuleReuseError, shard_lightning_module
from lightning_vitscale.sharding.sharded_model import ShardedModel
from lightning_vitscale.sharding.skipped_blocks import SkippedBlocksError
from lightning_vitscale.sharding.stand_ins import RepeatedBlockError, finishing_forward, joining_on_loss
from lightning_vitscale.sharding.summary import SetupSummary
from lightning_vitscale.sharding.sync_batchnorm import apply_sync_batchnorm

__all__ = [
    "TensorPlanSelector",
    "CheckpointSelector",
    "CheckpointingPolicy",
    "MixedTensorsError",
    "note_the_fix",
    "ModuleSelector",
    "NoBlocksMatchedError",
    "OffloadMode",
    "BackwardOutsideManualBackwardError",
    "InStepCallError",
    "OutsideStepCallError",
    "ParallelConfig",
    "ParameterWriteError",
    "Priority",
    "RepeatedBlockError",
    "ResolvedConfig",
    "SecondBackwardError",
    "SkippedBlocksError",
    "SetupSummary",
    "ShardedModel",
    "ShardedModuleReuseError",
    "ShardingLayout",
    "ShardingPolicy",
    "SkippedBlocks",
    "apply_sync_batchnorm",
    "finishing_forward",
    "joining_on_loss",
    "naming_graph_inputs",
    "resolve_config",
    "shard_group_size",
    "shard_lightning_module",
]

