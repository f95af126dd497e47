"""Skipping gradient reduction on micro-batches before the last (Lightning's ``block_backward_sync``, DDP's
``no_sync``): every FSDP unit accumulates unsharded gradients, the last micro-batch reduces the sum once. Averaging
is linear, so the result equals reducing each micro-batch: the gradients DDP produces."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def unsharded_gradient_bytes(module: nn.Module, compute_dtype: torch.dtype) -> int:
    """Bytes of every unit's unsharded gradients (in the compute dtype) alive at once: what skipping the sync costs
    (with it on, one unit's exist at a time)."""
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)  # DTensor.numel(): the full size
    return numel * torch.empty((), dtype=compute_dtype).element_size()


@contextmanager
def gradient_sync_off(root: nn.Module) -> Generator[None, None, None]:
    """Every FSDP unit under ``root`` accumulates unsharded gradients instead of reducing them, until exit."""
    if not isinstance(root, FSDPModule):
        yield
        return
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
