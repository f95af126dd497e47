"""Faster kernels, chosen by ``kernels=``: per-block ``torch.compile`` (and taking over a user's
``torch.compile(model)``), attention routed to the fastest backend, fused and foreach optimizer steps, and the
tensor-core shape report.

May import ``_utils`` and ``_compat`` only: what to compile or route is handed in by the caller.
"""

from lightning_vitscale.kernels.attention import (
    AttentionRouter,
    auto_attention_step,
    describe_router,
    make_router,
    route_blocks,
    usable_backends,
)
from lightning_vitscale.kernels.compile import apply_regional_compile, take_over_compiled
from lightning_vitscale.kernels.optimizers import prepare_optimizers
from lightning_vitscale.kernels.settings import (
    NO_BATCH,
    Compiler,
    KernelMode,
    KernelPolicy,
    resolve_kernels,
    with_compile_choice,
)
from lightning_vitscale.kernels.tensor_cores import tensor_core_report

__all__ = [
    "NO_BATCH",
    "AttentionRouter",
    "Compiler",
    "KernelMode",
    "KernelPolicy",
    "apply_regional_compile",
    "auto_attention_step",
    "with_compile_choice",
    "describe_router",
    "make_router",
    "prepare_optimizers",
    "resolve_kernels",
    "route_blocks",
    "tensor_core_report",
    "take_over_compiled",
    "usable_backends",
]
