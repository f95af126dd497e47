"""What one block's forward does, counted op by op on fake tensors (riding along :mod:`.activations`' passes): the
work a step runs and a checkpointed block repeats.

A full recompute reruns the forward as far as backward needs (torch's early stop); a selective one the ops it does
not save (all but :data:`~.selective_ops.SAVED_OPS`). Expensive ops count in FLOPs by torch's ``flop_registry``,
cheap ones in the bytes they read and write (views none), every op in ``ops``: what the host dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from lightning_vitscale._compat import TorchDispatchMode, op_mutates, storage_id, tree_leaves
from lightning_vitscale.memory.selective_ops import SAVED_OPS


@dataclass(frozen=True)
class BlockWork:
    """One forward of one block for the measured batch: the expensive ops' ``flops``, the cheap ops' bytes and count
    (what selective checkpointing recomputes), all ``ops``; ``recompute``: a full recompute's (``None``: the whole
    forward). :class:`OpWork` also counts the expensive ops' output bytes: what selective checkpointing keeps."""

    flops: int = 0
    cheap_bytes: int = 0
    ops: int = 0
    cheap_ops: int = 0
    recompute: BlockWork | None = None

    @property
    def repeated(self) -> BlockWork:
        """What a full recompute runs."""
        return self.recompute if self.recompute is not None else self

    def times(self, share: float) -> BlockWork:
        """The work of a step's calls of the block, ``share`` of this one's (a block every layer shares runs once
        per layer; smaller calls count as fractions), recompute included. Ops are launched once per call: the
        caller counts them by ``share`` too, rounded (the host time is an estimate)."""
        if share == 1:
            return self
        again = None if self.recompute is None else self.recompute.times(share)
        return BlockWork(round(self.flops * share), round(self.cheap_bytes * share), round(self.ops * share),
                         round(self.cheap_ops * share), again)


class OpWork(TorchDispatchMode):
    """Counts :class:`BlockWork` while active and ``counting`` (a forward's ops, not its backward's)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.cheap_bytes = self.ops = self.cheap_ops = self.saved_bytes = 0
        self.counting = True

    def result(self) -> BlockWork:
        return BlockWork(self.flops, self.cheap_bytes, self.ops, self.cheap_ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.counting:
            return out
        self.ops += 1
        packet = func.overloadpacket
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        if func in SAVED_OPS:
            self.saved_bytes += sum(t.untyped_storage().nbytes() for t in tensors_of(out))
        else:
            self.cheap_ops += 1
            self.cheap_bytes += _bytes_moved(func, args, kwargs, out)
        return out


def tensors_of(tree: Any) -> list[torch.Tensor]:
    return [v for v in tree_leaves(tree) if isinstance(v, torch.Tensor)]


def _bytes_moved(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """Bytes an op reads and writes: its tensor inputs and outputs; nothing for a view (output aliases input)."""
    inputs, outputs = tensors_of((args, kwargs)), tensors_of(out)
    sources = {storage_id(t) for t in inputs}
    if not op_mutates(func) and all(storage_id(t) in sources for t in outputs):
        return 0
    return sum(t.numel() * t.element_size() for t in [*inputs, *outputs])
