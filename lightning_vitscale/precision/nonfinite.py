"""The non-finite step guard of reduced-precision runs: every rank skips an optimizer step whose loss or gradients
are not finite on *any* rank; the run stops after ``max_consecutive`` such steps in a row.

Why: in bf16 one rank's inf/NaN gradient is reduced into every shard and the optimizer writes NaN into the weights
and every later checkpoint. Under fp16 the loss scaler skips overflows itself: the guard watches only the loss. One
all-reduce decides, so all ranks skip, and raise, together (Lightning's ``SpikeDetection`` skips nothing).

Two ways to skip: :meth:`NonFiniteGuard.should_skip` reads the decision on the host before the step (one device
sync a step, for any optimizer); :meth:`NonFiniteGuard.skip_on_device` hands it to a fused optimizer step as its
``found_inf`` (torch's fused Adam/AdamW/SGD/Adagrad leave weights and state untouched where it is set), and the host
reads it one step later. On a GPU the sync drained the queue every step: the loop's and the optimizer's host work
then ran with the device idle (the throughput model's "after the step's sync", ~8 ms of a 111 ms ViT-H/14 step at
batch 32 on the H200).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_vitscale._compat import amp_unscale_and_check
from lightning_vitscale.distributed.teardown import RaisedOnEveryRank
from lightning_vitscale.precision.grad_scaler import local_groups


class NonFiniteTrainingError(RaisedOnEveryRank, RuntimeError):
    """``max_consecutive`` optimizer steps in a row were skipped for non-finite loss or gradients (decided by one
    all-reduce, so every rank raises it at the same step)."""


@dataclass
class _Pending:
    """One step's flags on their way to the host: copied behind the step's own work, so reading them waits for that
    point of the queue, not for the steps queued since."""

    flags: torch.Tensor
    step: int
    done: Any = None  # the device event after the copy; None where the flags are on the host already

    @classmethod
    def of(cls, flags: torch.Tensor, step: int) -> _Pending:
        if flags.device.type == "cpu":
            return cls(flags, step)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        if flags.is_cuda:
            done: Any = torch.cuda.Event()
            done.record(torch.cuda.current_stream(flags.device))
        else:
            done = torch.Event(device=flags.device)
            done.record()
        return cls(host, step, done)

    def read(self) -> list[list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return self.flags.tolist()


@dataclass
class NonFiniteGuard:
    """Skip optimizer steps with a non-finite loss (and, ``check_gradients``, gradients: not under fp16, whose
    scaler owns them) on any rank; :class:`NonFiniteTrainingError` after ``max_consecutive`` in a row."""

    max_consecutive: int = 3
    check_gradients: bool = True
    skipped: int = field(default=0, init=False)  # steps skipped in this run (read so far), for the user and tests
    consecutive: int = field(default=0, init=False)
    decided_on_device: int = field(default=0, init=False)  # steps whose decision went to a fused step as found_inf
    _pending: deque[_Pending] = field(default_factory=deque, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_consecutive, int) or isinstance(self.max_consecutive, bool):
            raise TypeError(f"max_consecutive must be an int >= 1; got {self.max_consecutive!r}.")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1 (1: stop at the first non-finite step); got"
                             f" {self.max_consecutive}.")

    def should_skip(self, loss: torch.Tensor | None, grads: Iterable[torch.Tensor], step: int) -> bool:
        """Whether every rank skips this step (one all-reduce, read now); raises after ``max_consecutive`` in a
        row."""
        self.settle()
        return self._count(_flags(loss, list(grads) if self.check_gradients else []).tolist(), step)

    def skip_on_device(self, loss: torch.Tensor | None, grads: Iterable[torch.Tensor], step: int,
                       device: torch.device) -> torch.Tensor:
        """``found_inf`` for a fused optimizer step on ``device``: 1.0 where any rank's loss or gradients are not
        finite, the same on every rank. The host counts, warns and raises when it reads it: at the next call, or at
        :meth:`settle`. A stop after ``max_consecutive`` comes one step later than :meth:`should_skip`'s; that step's
        update is still skipped on the device if it is not finite."""
        self.settle()
        flags = _flags(loss, list(grads) if self.check_gradients else [])
        self._pending.append(_Pending.of(flags, step))
        self.decided_on_device += 1
        return (flags.sum() > 0).to(device=device, dtype=torch.float32)

    def settle(self) -> None:
        """Count the steps whose flags :meth:`skip_on_device` left on the device (raises as :meth:`should_skip`)."""
        while self._pending:
            pending = self._pending.popleft()
            self._count(pending.read(), pending.step)

    def close(self) -> None:
        """At the end of a fit, even one ended by an exception: the flags still pending are counted and warned about
        but raise nothing (the fit is over; a stop would hide its own error), so a next fit with this guard reads
        none of them as its own. Flags a failed device cannot hand back are dropped with that fit."""
        while self._pending:
            pending = self._pending.popleft()
            try:
                flags = pending.read()
            except RuntimeError:  # the device failed with the fit (a CUDA error is sticky): nothing left to count
                self._pending.clear()
                return
            self._count(flags, pending.step, stop=False)

    def _count(self, flags: list[list[float]], step: int, stop: bool = True) -> bool:
        loss_row, grad_row = flags
        loss_ranks = [r for r, v in enumerate(loss_row) if v]
        grad_ranks = [r for r, v in enumerate(grad_row) if v]
        if not loss_ranks and not grad_ranks:
            self.consecutive = 0
            return False
        self.skipped += 1
        self.consecutive += 1
        # Gradients are reduced across ranks, so one rank's NaN reaches every rank's gradients: name the losses.
        where = "; ".join(
            f"{what} on rank(s) {ranks}" for what, ranks in (("loss", loss_ranks), ("gradients", grad_ranks)) if ranks
        )
        if stop and self.consecutive >= self.max_consecutive:
            self._pending.clear()
            raise NonFiniteTrainingError(
                f"Non-finite values at {self.consecutive} optimizer steps in a row (the last at global step {step}:"
                f" {where}): stopped before the weights or a checkpoint become NaN; none of these steps was"
                " applied. Look for a bad batch or a too-high learning rate, or raise"
                " VitScalePrecision(..., max_skipped_steps=...) to tolerate more in a row."
            )
        rank_zero_warn(
            f"Non-finite values at global step {step} ({where}): optimizer step skipped on every rank"
            f" ({self.consecutive} in a row; the run stops at {self.max_consecutive})."
        )
        return True


@torch.no_grad()
def _flags(loss: torch.Tensor | None, grads: list[torch.Tensor]) -> torch.Tensor:
    """``[2, world]``: row 0 the ranks whose loss, row 1 those whose gradient shards hold an inf/NaN (nonzero).
    Each rank sets its two slots of one tensor, one SUM all-reduce (none on one rank) tells all; nothing is read.

    GradScaler's fused multi-tensor check, a few kernels per device and dtype: a per-tensor ``isfinite().all()``
    launched ~1,600 kernels a step on ViT-H, host time that made a 1-GPU step host-bound on the H200. Its multiply
    by ``inv_scale = 1`` changes no value (NaN, inf and -0.0 included)."""
    groups = local_groups(grads)
    device = loss.device if loss is not None else next(iter(groups))[0] if groups else torch.device("cpu")
    bad = torch.zeros(2, device=device)  # this rank's [loss, gradients], 1.0 where not finite
    if loss is not None:
        bad[0] = ~torch.isfinite(loss.detach()).all()
    found_here = bad[1:]
    for (group_device, _), group in groups.items():
        found = found_here if group_device == device else torch.zeros(1, device=group_device)
        amp_unscale_and_check(group, found, torch.ones(1, device=group_device))
        if found is not found_here:
            found_here += found.to(device)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return bad.view(2, 1)
    flags = torch.zeros(2, world, device=device)
    flags[:, dist.get_rank()] = bad
    dist.all_reduce(flags)  # SUM: slot r of each row is rank r's own flag
    return flags
