"""A gradient reaching a shard itself during backward is added after the reductions in flight wrote the shard's
gradient, on an accelerator.

FSDP2 reduces each unit's gradients on its own streams (reduce-scatter; all-reduce under hybrid sharding) and sets
the result as the sharded parameter's gradient there; the compute stream waits for it only when backward ends. A
term on the parameters taken before the forward (an L2 term over ``self.parameters()``: ``whole_terms.py``)
backpropagates after every unit, into the shards themselves, and autograd adds its gradient into that gradient on the
compute stream while the reduction may still be writing it. On CPU ranks the same race was seen and is closed by
``cpu_overlap.py`` (the reductions there are this package's own); here each sharded parameter's gradient hook makes
the stream autograd accumulates on wait for the unit's reduction streams (offloaded shards: the host waits for
them). The forward never uses the shards, so the hook runs only for such terms (a few microseconds per term).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import reduction_streams, unit_parameters
from lightning_vitscale._utils import register_gradient_hook


def wait_for_reductions(units: list[FSDPModule], device: torch.device) -> None:
    """On an accelerator, hook every sharded parameter of ``units``, frozen ones too (see the module docstring)."""
    if device.type != "cpu":
        offloaded = any(p.device.type == "cpu" for unit in units for p in unit_parameters(unit))
        hook_shards(units, offloaded)


def hook_shards(units: list[FSDPModule], offloaded: bool) -> None:
    """``offloaded``: the shards live on the host (FSDP2 copies each reduced gradient there asynchronously)."""
    for unit in units:
        hook = functools.partial(_after_reductions, unit, offloaded)
        for param in unit_parameters(unit):
            register_gradient_hook(param, hook)


def _after_reductions(unit: FSDPModule, offloaded: bool, grad: torch.Tensor) -> None:
    streams = reduction_streams(unit)
    if offloaded:
        for stream in streams:
            stream.synchronize()
        return
    if not streams:
        return
    current = current_stream(grad.device)
    for stream in streams:
        current.wait_stream(stream)


def current_stream(device: torch.device) -> Any:
    """The stream autograd runs this node on (and then accumulates on)."""
    return torch.get_device_module(device.type).current_stream(device)
