"""Where the tensor-parallel plan always was: it lives in ``discovery/tensor_plan.py`` now (reading a block's
structure, policy only), below the memory planner, which splits a measured twin by the same plan."""

from lightning_vitscale.discovery.tensor_plan import (
    HEAD_COUNTS,
    HEAD_WIDTHS,
    TENSOR_LAYOUT_KEY,
    BlockPlan,
    Role,
    TensorPlanError,
    TensorPlanSelector,
    plan_block,
    tensor_layout,
)

__all__ = [
    "HEAD_COUNTS",
    "HEAD_WIDTHS",
    "TENSOR_LAYOUT_KEY",
    "BlockPlan",
    "Role",
    "TensorPlanError",
    "TensorPlanSelector",
    "plan_block",
    "tensor_layout",
]
