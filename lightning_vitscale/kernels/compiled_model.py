"""``trainer.fit(torch.compile(model))``: compile each repeated block with the user's settings instead.

Lightning's ``from_compiled`` makes the LightningModule's ``forward`` and ``*_step`` compiled functions; a whole
compiled step would trace FSDP2's hooks and collectives. The recipe compiles each block inside its FSDP unit instead
(``KernelPolicy(compile_blocks=True)``), so the strategy restores the plain methods and compiles the blocks with the
user's ``torch.compile`` context (same backend, mode and options).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_vitscale._compat import compile_context
from lightning_vitscale.kernels.settings import Compiler

TAKEN_OVER = (
    "VitScaleStrategy: `torch.compile(model)` is applied to each repeated block instead of the whole LightningModule"
    " (regional compilation, with your torch.compile settings; FSDP's gathers stay eager between blocks), as"
    " `VitScaleStrategy(kernels=KernelPolicy(compile_blocks=True))` does. Pass the plain model to silence this."
)


def take_over_compiled(module: Any) -> Compiler | None:
    """Undo Lightning's ``from_compiled`` on ``module``; return the user's compile context (``None``: not compiled)."""
    compiler = compile_context(module)
    if compiler is not None:
        to_uncompiled(module)
        rank_zero_info(TAKEN_OVER)
    return compiler
