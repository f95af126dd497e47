"""DDP's buffer sync: a forward while fitting starts from rank 0's buffers when DDP's would.

DDP broadcasts its module's buffers from rank 0 before a forward (``broadcast_buffers=True``, its default) when the
forward before it ran with gradients on and their sync required (its ``require_forward_param_sync``): so after
each synced training step, not after a micro-batch inside ``no_sync`` (gradient accumulation) or an evaluation
step, and, under Lightning's manual optimization (which turns the sync off around every forward), only at a fit's
first forward. BatchNorm's running statistics on every rank are then rank 0's where DDP's are, and so are the
validation losses each rank computes with them and the metrics logged with ``sync_dist=True``. Lightning's DDP
syncs the buffers once when it sets up to validate, test or predict outside a fit (``_sync_module_states``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import buffer_slots
from lightning_vitscale.distributed.mesh import broadcast_from_rank_zero


class BufferSync:
    """One fit's buffer sync for the outer unit to run around each step's forward (a new one per fit, as Lightning
    wraps the model in a new DDP). The owners are found once, their buffers read at each sync (a forward may rebind
    one). Buffers a tensor-parallel plan placed stay as they are."""

    def __init__(self, owners: list[nn.Module]) -> None:
        self.owners = owners
        self.due = True  # DDP's first forward syncs
        self.gradients_synced = True

    @classmethod
    def of(cls, module: nn.Module) -> BufferSync | None:
        """``None`` for a model without buffers (a ViT: nothing sent)."""
        owners = [m for m in module.modules() if buffer_slots(m)]
        return cls(owners) if owners else None

    def sync(self) -> None:
        """Rank 0's buffers on every rank now (a collective)."""
        broadcast_from_rank_zero([t for m in self.owners for t in buffer_slots(m).values()
                                  if t is not None and not isinstance(t, DTensor)])

    def before_forward(self) -> None:
        if self.due:
            self.sync()

    def after_forward(self, manual_optimization: bool) -> None:
        self.due = torch.is_grad_enabled() and self.gradients_synced and not manual_optimization

    @contextmanager
    def gradients_unsynced(self) -> Iterator[None]:
        """A micro-batch before the last of an accumulation window: DDP's ``no_sync``."""
        self.gradients_synced = False
        try:
            yield
        finally:
            self.gradients_synced = True
