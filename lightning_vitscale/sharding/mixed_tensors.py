"""Torch's "got mixed torch.Tensor and DTensor" from a step's own arithmetic on parameters, named with its fix.

Under DDP every parameter is a plain tensor. Here a parameter is a DTensor (its shard) wherever its unit is not
gathered: outside the forwards, a block unit's parameters are, while the outer unit's are gathered for the whole
step. So an L2 term over ``self.parameters()``, or a distance to plain saved weights (L2-SP), taken in
``training_step`` mixes the two, and torch names neither the parameter nor the fix. Tried and left: letting DTensor
take the plain tensors as replicated (autograd then hands a DTensor gradient to the plain graph of the loss), and
each DTensor term made whole with ``full_tensor()`` (it runs, with other gradients than DDP's: 0.5% off in the loss
after one step, on 2 ranks).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

MIXED = "got mixed torch.Tensor and DTensor"


class MixedTensorsError(RuntimeError):
    """A step mixed a sharded parameter (a DTensor) with a plain tensor."""


@contextmanager
def mixed_tensors_named() -> Generator[None, None, None]:
    try:
        yield
    except RuntimeError as error:
        if MIXED not in str(error) or isinstance(error, MixedTensorsError):
            raise
        raise MixedTensorsError(
            f"{error}\nA step's arithmetic mixed a parameter VitScaleStrategy holds sharded (a DTensor: outside its"
            " FSDP unit's forward, e.g. an L2 term over `self.parameters()` or a distance to saved plain weights in"
            " `training_step`) with a plain tensor; under DDP both are plain. A term on the parameters themselves has"
            " no gradient path through the shards: for an L2 penalty use the optimizer's `weight_decay`; otherwise"
            " train this module with strategy='ddp', or on one device, where VitScaleStrategy's step computes on"
            " whole copies and such a term trains as under DDP."
        ) from error
