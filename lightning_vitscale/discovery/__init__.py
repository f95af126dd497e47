"""Reading a model: its repeated blocks (the FSDP and checkpointing units) and its normalization layers.

Pure functions over ``nn.Module`` trees, shared by sharding, precision and the memory planner; imports no
``torch.distributed`` and no other concern.
"""

from lightning_vitscale.discovery.blocks import (
    ModuleSelector,
    describe_blocks,
    find_blocks,
    find_modules,
    holds_parameters,
)
from lightning_vitscale.discovery.norms import is_normalization

__all__ = ["ModuleSelector", "describe_blocks", "find_blocks", "find_modules", "holds_parameters", "is_normalization"]
