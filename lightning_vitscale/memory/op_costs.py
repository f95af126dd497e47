"""What one block's forward does, counted op by op on fake tensors: the work a step runs and a checkpointed block
repeats.

A fully checkpointed block reruns its forward in backward, as far as backward needs (torch's early stop: a block
ending in a matmul whose output nothing saves does not rerun it); a selectively checkpointed one reruns only the
ops it does not save (everything but :data:`~lightning_vitscale.memory.selective_ops.SAVED_OPS`: norms,
activations, dropout, residual adds, casts). The expensive ops are counted in FLOPs with torch's own formulas
(``torch.utils.flop_counter.flop_registry``: matmuls, convolutions, attention); the cheap ones in the bytes they
read and write, which is what bounds them; every op, views included, once in ``ops``: what the host dispatches.
Views move nothing and count no bytes. Counting needs no memory and no device: it rides along the forward of the
planner's fake-tensor pass over the block (:mod:`.activations`), autograd on, and along a full recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from lightning_vitscale._compat import TorchDispatchMode, op_mutates, storage_id, tree_map
from lightning_vitscale.memory.selective_ops import SAVED_OPS


@dataclass(frozen=True)
class BlockWork:
    """One forward of one block for the measured batch, and what a full recompute of it repeats.

    Attributes:
        flops: floating-point operations of its expensive ops (what selective checkpointing saves).
        cheap_bytes: bytes read and written by the other ops (what selective checkpointing recomputes).
        ops: ops dispatched (views included): the host's work, whatever the batch.
        cheap_ops: of them, the ops selective checkpointing recomputes.
        recompute: a full recompute's own count (early stop included); ``None``: not measured, the whole forward.
    """

    flops: int = 0
    cheap_bytes: int = 0
    ops: int = 0
    cheap_ops: int = 0
    recompute: BlockWork | None = None

    @property
    def repeated(self) -> BlockWork:
        """What a full recompute runs."""
        return self.recompute if self.recompute is not None else self


class OpWork(TorchDispatchMode):
    """Sums the FLOPs of the ops torch has a formula for, the bytes moved by the ops selective checkpointing
    recomputes and the ops dispatched while active, until :meth:`stop` (a forward's ops, not its backward's)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.cheap_bytes = self.ops = self.cheap_ops = 0
        self.counting = True

    def stop(self) -> None:
        self.counting = False

    def result(self, recompute: BlockWork | None = None) -> BlockWork:
        return BlockWork(self.flops, self.cheap_bytes, self.ops, self.cheap_ops, recompute)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.counting:
            return out
        self.ops += 1
        packet = func.overloadpacket
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        if func not in SAVED_OPS:
            self.cheap_ops += 1
            self.cheap_bytes += _bytes_moved(func, args, kwargs, out)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda v: found.append(v) if isinstance(v, torch.Tensor) else None, tree)
    return found


def _bytes_moved(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """Bytes an op reads and writes: its tensor inputs and outputs; nothing for a view (output aliases input)."""
    inputs, outputs = _tensors((args, kwargs)), _tensors(out)
    sources = {storage_id(t) for t in inputs}
    if not op_mutates(func) and all(storage_id(t) in sources for t in outputs):
        return 0
    return sum(t.numel() * t.element_size() for t in [*inputs, *outputs])
