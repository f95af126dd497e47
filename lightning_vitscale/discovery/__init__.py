"""Reading a model: its repeated blocks (the FSDP and checkpointing units), what a run of it calls (``calls.py``),
its normalization layers and the tensor-parallel role of each module of a block (``tensor_plan.py``).

Pure functions over ``nn.Module`` trees, shared by sharding, precision and the memory planner; imports no
``torch.distributed`` and no other concern.
"""

from lightning_vitscale.discovery.blocks import (
    ModuleSelector,
    describe_blocks,
    find_blocks,
    find_modules,
    find_units,
    holds_parameters,
    parameter_holder,
)
from lightning_vitscale.discovery.norms import is_normalization

__all__ = [
    "ModuleSelector", "describe_blocks", "find_blocks", "find_modules", "find_units", "holds_parameters",
    "parameter_holder",
    "is_normalization",
]
