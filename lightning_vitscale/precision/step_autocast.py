"""A step's own arithmetic computed as under DDP's AMP, the model's layers as O2.

DDP's ``"bf16-mixed"`` runs each step inside ``torch.autocast``: the loss on a model's bf16 logits computes in fp32
(``F.cross_entropy``, a hand-written soft-target loss's ``log_softmax`` on CUDA), and a term applying a weight to the
fp32 batch computes in bf16. O2 computes the layers in bf16 on purpose, but left the step's own code around them to
plain arithmetic: a loss logged as ``2.3125`` where DDP logs ``2.3026``, with a bf16 gradient, and fp32 data against
a block's gathered bf16 weight raised torch's "expected m1 and m2 to have the same dtype".

So under the mixed flags the plugin runs each step inside ``torch.autocast(device, compute dtype)``, as Lightning's
``MixedPrecision`` does, and each module of the model that holds parameters of its own outside the blocks, and each
block, runs its forward with autocast off (:func:`layers_compute_as_o2`): inside them O2, as before, bit for bit;
around them DDP's step. Checkpointing's recompute restores the forward's state (off) by itself.

Torch keeps a nesting count of autocast regions, which ``_compat.autocast_turned_off`` reads to find a step's own
``torch.autocast(..., enabled=False)`` (kept in fp32 by setup): :data:`AUTOCAST_FLOOR` says how many of the open
regions are the strategy's, so neither the step's region nor a layer turned off here reads as the user's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import autocast_nesting
from lightning_vitscale._utils import AUTOCAST_FLOOR


@contextmanager
def step_under_autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """The body (a step) inside ``torch.autocast(device_type, dtype)``, its layers O2 (:func:`layers_compute_as_o2`).
    Inside a step already (a step inside a step), nothing more."""
    if AUTOCAST_FLOOR.device is not None:
        yield
        return
    outer_floor = AUTOCAST_FLOOR.level
    with torch.autocast(device_type, dtype=dtype):
        AUTOCAST_FLOOR.device, AUTOCAST_FLOOR.level, AUTOCAST_FLOOR.turned_off = device_type, autocast_nesting(), []
        try:
            yield
        finally:  # a layer that raised left autocast off: torch.autocast's exit restores what was before the step
            AUTOCAST_FLOOR.device, AUTOCAST_FLOOR.level, AUTOCAST_FLOOR.turned_off = None, outer_floor, []


def _turn_off(module: nn.Module, args: Any) -> None:
    device = AUTOCAST_FLOOR.device
    if device is None or not torch.is_autocast_enabled(device):  # outside a step, inside an off layer or region
        AUTOCAST_FLOOR.turned_off.append(None)
        return
    AUTOCAST_FLOOR.turned_off.append(AUTOCAST_FLOOR.level)
    AUTOCAST_FLOOR.level = autocast_nesting()
    torch.set_autocast_enabled(device, False)


def _turn_back_on(module: nn.Module, args: Any, output: Any) -> None:
    if not AUTOCAST_FLOOR.turned_off:  # a hook of a forward that began outside the step
        return
    floor = AUTOCAST_FLOOR.turned_off.pop()
    if floor is not None and AUTOCAST_FLOOR.device is not None:
        torch.set_autocast_enabled(AUTOCAST_FLOOR.device, True)
        AUTOCAST_FLOOR.level = floor


def layers_compute_as_o2(modules: Iterable[nn.Module]) -> None:
    """Each of ``modules`` runs its forward with the step's autocast off: before every other pre-hook (FSDP2's gather
    and cast, the layer's input cast), back on after every other hook, also where the forward raised."""
    for module in modules:
        module.register_forward_pre_hook(_turn_off, prepend=True)
        module.register_forward_hook(_turn_back_on, always_call=True)
