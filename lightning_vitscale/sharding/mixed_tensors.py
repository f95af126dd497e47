"""Torch's "got mixed torch.Tensor and DTensor" from a step's own code on parameters, named with its fix.

Under DDP every parameter is a plain tensor. Here a parameter is a DTensor (its shard) wherever its unit is not
gathered: outside the forwards, a block unit's parameters are. A term computed on them in ``training_step`` (an L2
term over ``self.parameters()``, L2-SP) is taken whole where it meets the plain loss (``whole_terms.py``); what is
left is a plain tensor written in place into a shard (a block weight reset to saved values in the step), which a
shard cannot hold, and mixed arithmetic outside the training step. Torch names neither the parameter nor the fix.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

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
            f"{error}\nA step mixed a parameter VitScaleStrategy holds sharded (a DTensor: outside its FSDP unit's"
            " forward) with a plain tensor where it cannot be taken whole: a plain (whole) tensor written in place into"
            " the shard, e.g. `p.copy_(saved)` in `training_step`; under DDP both are plain. Write the shard of the"
            " whole value instead: `p.copy_(distribute_tensor(saved, p.device_mesh, p.placements))` (from"
            " torch.distributed.tensor), load whole values with `self.load_state_dict(...)` outside the step, or"
            " train this module with strategy='ddp'."
        ) from error


# torch's messages where code written for DDP's whole tensors met a parameter or gradient held as a DTensor shard
# (`.numpy()` of one says what to do itself: distributed/array_reads.py).
_READ_AS_WHOLE = (MIXED,)

READ_AS_WHOLE_FIX = (
    "VitScaleStrategy: this read a parameter (or a gradient) as DDP's whole tensor, but outside the step each rank"
    " holds only its shard, a DTensor."
    " Make whole values on every rank, then use them on any: `full = self.state_dict()` (DDP's full tensors; a"
    " collective, so not under `if self.global_rank == 0:`), or `p.full_tensor()` / `p.grad.full_tensor()` for one."
    " A copy of the model made after setup (`AveragedModel(self.net)` or `copy.deepcopy` in `on_fit_start` or a"
    " callback) is plain and cannot be updated from the shards: make it in `__init__` or `setup()`, so the strategy"
    " shards it with the model and its update runs shard by shard, or use Lightning's `EMAWeightAveraging` callback"
    " or `lightning_vitscale.ShardedEMA`."
)


EMPTY_SHARD_FIX = (
    "VitScaleStrategy: a parameter whose first dimension is shorter than the number of ranks (a `[1, 1, D]` class"
    " token, a `[1]` scale) has an empty shard on some ranks, and torch has no infinity norm of an empty tensor (this"
    " rank raised alone). Take gradient norms with `lightning_vitscale.grad_norm(module, norm_type)` (any norm,"
    " DDP's values), clip with `Trainer(gradient_clip_val=...)`, or read `p.grad.abs().max()` (which works)."
)

# torch's messages and the fix each gets (see note_the_fix)
_FIXES = {
    **dict.fromkeys(_READ_AS_WHOLE, READ_AS_WHOLE_FIX),
    "norm on an empty tensor": EMPTY_SHARD_FIX,  # linalg.vector_norm's (ord=inf) and _foreach_norm's
}


def note_the_fix(error: BaseException) -> None:
    """Add the fix to torch's error where code written for DDP's whole tensors met a shard (a callback logging weight
    histograms, an infinity norm of an empty shard): it shows under the traceback (PEP 678 notes; Python 3.10:
    logged)."""
    if isinstance(error, MixedTensorsError):
        return
    fix = next((fix for text, fix in _FIXES.items() if text in str(error)), None)
    if fix is None or fix in getattr(error, "__notes__", ()):
        return
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(fix)
    else:
        rank_zero_warn(fix)
