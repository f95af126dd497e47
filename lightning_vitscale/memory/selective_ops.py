"""Which ops selective activation checkpointing stores (the expensive ones), and the context pair that does it: here,
below the sharding setup, because the planner measures a selective block with the same policy."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_vitscale._compat import (
    checkpointed_op_output,
    op_mutates,
    storage_id,
    tree_leaves,
    written_arguments,
)

_aten = torch.ops.aten
_SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
SAVED_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name).default for name in _SAVED_OP_NAMES if hasattr(_aten, name)
)
"""Ops that cost FLOPs (``linear`` reaches the dispatcher as ``mm``/``addmm``, SDPA as a fused kernel or ``bmm``)."""


class SelectiveCheckpointingError(ValueError):
    """A block asked to checkpoint selectively cannot run so (it changes in place an output selective checkpointing
    keeps, or calls another block): what to fix, raised at setup (the step would fail at its first backward)."""


class _SaveExpensiveOps:
    """The policy of one checkpointed call: the expensive ops' outputs kept (``MUST_SAVE``, not ``PREFER_SAVE``:
    torch.compile's partitioner may otherwise recompute a matmul to save memory), everything else recomputed.

    It refuses a forward that writes in place into a kept output's storage. torch checks a kept tensor's version
    counter, which such a write can pass by: ``matmul`` returns its ``bmm`` output through ``_unsafe_view``, a
    tensor with a counter of its own, so timm MViTv2's ``attn[:, :, 1:, 1:] = ...`` (relative positions added in
    place) left the kept ``bmm`` output changed, the recompute added them a second time, and the gradients were
    silently wrong. Raised here, the planner measures the block as unable to run selectively. torch 2.11 shows a
    policy no op's output, so there (below the tested floor) the check cannot run."""

    def __init__(self) -> None:
        self.kept: set[int] = set()  # storages of the outputs kept in this call's forward

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in SAVED_OPS:
            if not ctx.is_recompute:
                output = checkpointed_op_output(ctx)  # None on torch 2.11: the check below cannot run there
                self.kept.update(storage_id(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor))
            return CheckpointPolicy.MUST_SAVE
        if self.kept and not ctx.is_recompute and op_mutates(op):
            written = written_arguments(op, args)
            if any(isinstance(t, torch.Tensor) and storage_id(t) in self.kept for t in tree_leaves(written)):
                raise RuntimeError(
                    f"{op} writes in place into the output of a matmul or convolution that selective activation"
                    " checkpointing keeps; the recompute would run on the changed value."
                )
        return CheckpointPolicy.PREFER_RECOMPUTE


def blocks_calling_blocks(blocks: list[tuple[str, torch.nn.Module]]) -> dict[str, str]:
    """Each block that holds another block (timm CoaT's position encodings, shared by the blocks that call them) ->
    that block's name. The inner block is a unit of its own, so its parameters are gathered inside the outer block's
    forward, and not again in the recompute where they are still gathered, or again where they are not: selective
    checkpointing, which replays the forward's ops by count, fails at the first backward (torch: "aten.empty...
    encountered during backward but not found in storage"). Full checkpointing counts no ops and runs them."""
    names = {id(block): name for name, block in blocks}
    calling = {}
    for name, block in blocks:
        inner = next((names[id(m)] for m in block.modules() if m is not block and id(m) in names), None)
        if inner is not None:
            calling[name] = inner
    return calling


def calls_another_block_error(name: str, inner: str) -> SelectiveCheckpointingError:
    return SelectiveCheckpointingError(
        f"{name} cannot be checkpointed selectively: it calls {inner}, a block with a unit of its own, whose"
        " parameters are gathered inside its forward, and the recompute would gather them where its forward did"
        " not. Give it activation_checkpointing='full' (a callable may choose per block).")


def refuse_selective_calling_blocks(blocks: list[tuple[str, torch.nn.Module]], selective: list[str]) -> None:
    """At setup, for a plan the planner could not measure: a block of ``selective`` calling another is the error."""
    calling = blocks_calling_blocks(blocks)
    for name in selective:
        if name in calling:
            raise calls_another_block_error(name, calling[name])


def selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_SaveExpensiveOps())


