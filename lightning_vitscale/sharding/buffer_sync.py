"""DDP's buffer sync: while fitting, every step starts from rank 0's buffers.

DDP broadcasts its module's buffers from rank 0 at each forward (``broadcast_buffers=True``, its default), so
BatchNorm's running statistics on every rank are rank 0's, and so are the validation losses each rank computes with
them. Without it each rank's statistics follow its own batches, and the validation metrics logged with
``sync_dist=True`` differ from DDP's.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import buffer_slots
from lightning_vitscale.distributed.mesh import broadcast_from_rank_zero


def buffer_sync(module: nn.Module) -> Callable[[], None] | None:
    """The sync of ``module``'s buffers, for the outer unit to run before each step; ``None`` for a model without
    buffers (a ViT: nothing sent). The owners are found once, their buffers read at each call (a forward may rebind
    one). Buffers a tensor-parallel plan placed stay as they are."""
    owners = [m for m in module.modules() if buffer_slots(m)]
    if not owners:
        return None

    def sync() -> None:
        broadcast_from_rank_zero([t for m in owners for t in buffer_slots(m).values()
                                  if t is not None and not isinstance(t, DTensor)])

    return sync
