"""An exponential moving average of a module's weights, held shard by shard exactly like the weights.

Each rank averages only the local tensor of each parameter (``DTensor.to_local()`` under FSDP2, the whole tensor
under DDP), so the average costs 4 bytes per parameter / world size and its update, swap and save need no
collective. The EMA is fp32 whatever the parameters' dtype (``bf16-true`` master weights included).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_vitscale._compat import dtensor_local, foreach_add_, foreach_copy_, foreach_lerp_, foreach_mul_
from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.row_layout import interleaved_rows, packed_rows


@dataclass
class _Group:
    """Entries updated by one foreach call: same EMA device, same source dtype, same rule."""

    indices: list[int]
    same_dtype: bool
    average: bool


class EmaShards:
    """The EMA of ``module``'s parameters and persistent buffers, one local fp32 tensor per entry. Local tensors are
    looked up again at each update: FSDP2 may replace a parameter's local tensor (loading a state dict), never the
    parameter itself. ``average_buffers``: floating buffers (BatchNorm statistics) averaged, else copied."""

    def __init__(self, module: nn.Module, average_buffers: bool = True, offload: bool = False) -> None:
        persistent = set(module.state_dict(keep_vars=True))
        entries: list[tuple[str, torch.Tensor, bool]] = [(n, p, True) for n, p in module.named_parameters()]
        entries += [(n, b, False) for n, b in module.named_buffers() if n in persistent]
        self.names = [strip_wrapper_prefixes(n) for n, _, _ in entries]
        self.packed = packed_rows(module)  # packed projections held in per-rank row order (tensor_parallel)
        self.sources: list[torch.Tensor] = [t for _, t, _ in entries]
        self.ema: list[torch.Tensor] = []
        keys: dict[tuple[Any, ...], _Group] = {}
        for index, (_, tensor, is_param) in enumerate(entries):
            local = dtensor_local(tensor).detach()
            floating = local.is_floating_point()
            ema = local.to(device="cpu" if offload else local.device, dtype=torch.float32 if floating else local.dtype)
            self.ema.append(ema.clone() if ema.data_ptr() == local.data_ptr() else ema)
            average = floating and (is_param or average_buffers)
            key = (ema.device, local.dtype, average)
            keys.setdefault(key, _Group([], local.dtype == ema.dtype, average))
            keys[key].indices.append(index)
        self.groups = list(keys.values())

    def locals(self) -> list[torch.Tensor]:
        return [dtensor_local(t).detach() for t in self.sources]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """``ema = decay * ema + (1 - decay) * weights`` on local tensors: one foreach op per group, no collective."""
        sources = self.locals()
        for group in self.groups:
            ema = [self.ema[i] for i in group.indices]
            src = [sources[i] for i in group.indices]
            if ema[0].device != src[0].device:  # offload: blocking copies, the CPU reads them right away
                src = [s.to(ema[0].device) for s in src]
            if decay == 0.0 or not group.average:
                foreach_copy_(ema, src)
            elif group.same_dtype:
                foreach_lerp_(ema, src, 1.0 - decay)
            else:  # low-precision master weights: accumulate into the fp32 EMA without a rounded temporary
                foreach_mul_(ema, decay)
                foreach_add_(ema, src, alpha=1.0 - decay)

    @contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """Run the block with the EMA copied into the module's local shards (rounded to their dtype; FSDP2 gathers
        from that storage), the raw weights in a local backup meanwhile."""
        sources = self.locals()
        backup = [s.clone() for s in sources]
        foreach_copy_(sources, self.ema)
        try:
            yield
        finally:
            foreach_copy_(self.locals(), backup)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA keyed like the model's state dict: DTensors sharded like their parameters (DCP reshards them
        to any world size), plain tensors where the parameters are plain (DDP). Shares storage, no copy."""
        out = {}
        for name, source, ema in zip(self.names, self.sources, self.ema):
            if isinstance(source, DTensor):
                ema = DTensor.from_local(
                    ema, source.device_mesh, source.placements, run_check=False, shape=source.shape,
                    stride=source.stride(),
                )
            out[name] = ema
        return out

    @torch.no_grad()
    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        """Load unsharded tensors (a DDP or consolidated checkpoint): each rank keeps its own slice, no collective."""
        missing = [n for n in self.names if n not in full]
        if missing:
            raise KeyError(f"{len(missing)} EMA tensor(s) missing from the checkpoint, e.g. {missing[:3]}")
        for name, source, ema in zip(self.names, self.sources, self.ema):
            value = full[name].to(dtensor_local(source).device)
            if name in self.packed:  # a full file holds the model's own row order
                value = interleaved_rows(value, *self.packed[name])
            if isinstance(source, DTensor):  # src_data_rank=None: every rank holds the full tensor already
                value = distribute_tensor(value, source.device_mesh, source.placements, src_data_rank=None)
                value = value.to_local()
            ema.copy_(value)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.ema)
