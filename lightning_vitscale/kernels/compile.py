"""Regional compilation: each repeated block's ``forward`` compiled in place, under the only dynamo config we set."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import dynamo
from lightning_vitscale.kernels.settings import Compiler

# dynamo's default number of compiled variants per code object (requires_grad, shapes, ...), per block class.
_VARIANTS_PER_CLASS = 8

_COMPILED = "_vitscale_compiled"

def apply_regional_compile(
    modules: list[nn.Module], mode: str | None = None, compiler: Compiler | None = None
) -> dict[str, int]:
    """Compile each module's ``forward`` (the blocks, and the outer layers if asked) in place; returns class
    name -> count.

    The instance's ``forward`` is replaced, so parameter names (and checkpoint keys) stay as they are
    (``torch.compile(module)`` would add ``_orig_mod.`` to every key). It is ``forward`` and not
    ``nn.Module.compile()``'s ``_call_impl`` that is compiled: ``_call_impl`` runs the module's hooks, and
    FSDP2's hooks (added later by ``fully_shard``) are ``dynamo.disable``-d, so every call would graph-break
    there; where the block's forward is torch's own code (``nn.TransformerEncoderLayer``) dynamo then ran the
    rest eagerly - compiled blocks without activation checkpointing compiled nothing. Like torchtitan's
    compile-then-shard, FSDP's hooks now run eagerly around the compiled forward. Call it after activation
    checkpointing (dynamo traces the checkpoint into a recompute region, so the memory saving survives).
    Identical blocks share compiled code through dynamo's cache: one compile per class (plus one variant
    when only the first block's input does not require grad). ``mode`` is checked by
    :class:`~lightning_vitscale.kernels.settings.KernelPolicy`. Each compiled call runs under two dynamo options, see
    :func:`dynamo_options`; they are set only while these modules run, never process-wide. ``compiler`` (the
    context of a user's ``torch.compile(model, ...)``) replaces ``torch.compile(mode=mode)``, keeping the user's
    backend and options.
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
    """The only dynamo config the package changes, applied around each compiled module's call.

    Dynamo reads these when a compiled module is called (tracing happens at the first call, the recompile
    budget is checked at every call), not at ``compile()``; so :func:`apply_regional_compile` patches them
    around each call and restores the user's settings afterwards.

    1. ``recompile_limit``: every checkpointed block runs through one wrapper function, so all block classes
       share its budget of compiled variants; give each class its own, or dynamo silently runs the extra ones
       eagerly.
    2. ``skip_fwd_side_effects_in_bwd_under_checkpoint``: the fp32-norm forwards (precision/norms.py) swap a norm's
       parameters for local tensors in forward and swap them back. Dynamo refuses such side effects inside a
       checkpoint region (it could not replay them on recompute), so without this the whole block
       graph-breaks and runs eagerly: measured here, a bf16 block compiled to nothing. The attention router
       (kernels/attention.py) entering its mode inside the block is the same kind of side effect. Not replaying is
       right for these net-zero changes, and for user side effects (a counter) it avoids counting twice,
       which eager recompute does.
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
