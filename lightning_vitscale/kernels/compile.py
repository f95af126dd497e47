"""Regional compilation: each repeated block's ``forward`` compiled in place, under the only dynamo config we set;
also for ``trainer.fit(torch.compile(model))``: Lightning's ``from_compiled`` compiles the LightningModule's
``forward`` and ``*_step``, and a whole compiled step would trace FSDP2's hooks and collectives, so the strategy
restores the plain methods and compiles the blocks with the user's ``torch.compile`` settings instead."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_vitscale._compat import compile_context, dynamo
from lightning_vitscale.kernels.settings import Compiler

# dynamo's default number of compiled variants per code object (requires_grad, shapes, ...), per block class.
_VARIANTS_PER_CLASS = 8

_COMPILED = "_vitscale_compiled"
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


def apply_regional_compile(
    modules: list[nn.Module], mode: str | None = None, compiler: Compiler | None = None
) -> dict[str, int]:
    """Compile each module's ``forward`` in place (keys keep their names: ``torch.compile(module)`` would add
    ``_orig_mod.``); returns class name -> count. ``forward``, not ``nn.Module.compile()``'s ``_call_impl``: that
    runs FSDP2's ``dynamo.disable``-d hooks, so every call graph-broke there, and torch's own block forwards then ran
    eagerly (compiled blocks without checkpointing compiled nothing). Call after activation checkpointing (traced
    into a recompute region). ``compiler``: a user's ``torch.compile(model, ...)`` context, used instead of ``mode``.
    """
    counts = Counter(type(module).__name__ for module in modules)
    compile_call = compiler if compiler is not None else functools.partial(torch.compile, mode=mode)
    for module in modules:
        if is_compiled(module):
            continue
        compiled = compile_call(module.forward)
        module.forward = _under_options(compiled, num_classes=len(counts))  # type: ignore[method-assign]
        setattr(module, _COMPILED, True)
    return dict(counts)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`apply_regional_compile` compiled this module's forward."""
    return bool(getattr(module, _COMPILED, False))


def dynamo_options(num_classes: int) -> dict[str, object]:
    """The only dynamo config the package changes, patched around each compiled call (dynamo reads it at call
    time), never process-wide.

    1. ``recompile_limit``: checkpointed blocks share one wrapper function and so its budget of variants; past
       it dynamo silently runs the extra classes eagerly.
    2. ``skip_fwd_side_effects_in_bwd_under_checkpoint``: the fp32-norm forwards (precision/norms.py) and the
       attention router swap state in and out within a checkpoint region; without it the block graph-breaks
       (measured: a bf16 block compiled to nothing). Not replaying is right for these net-zero changes, and
       avoids counting a user's side effect twice, as eager recompute does.
    """
    needed = _VARIANTS_PER_CLASS * max(num_classes, 1)
    return {
        "recompile_limit": max(dynamo.config.recompile_limit, needed),
        "skip_fwd_side_effects_in_bwd_under_checkpoint": True,
    }


def _under_options(call: Callable[..., Any], num_classes: int) -> Callable[..., Any]:
    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside a user's compiled region: its config applies
            return call(*args, **kwargs)
        with dynamo.config.patch(dynamo_options(num_classes)):
            return call(*args, **kwargs)

    return run
