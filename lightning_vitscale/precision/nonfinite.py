"""The non-finite step guard of reduced-precision runs: every rank skips an optimizer step whose loss or gradients
are not finite on *any* rank; the run stops after ``max_consecutive`` such steps in a row.

Why: in bf16 one rank's inf/NaN gradient is reduced into every shard and the optimizer writes NaN into the weights
and every later checkpoint. Under fp16 the loss scaler skips overflows itself: the guard watches only the loss. One
all-reduce decides, so all ranks skip, and raise, together (Lightning's ``SpikeDetection`` skips nothing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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
class NonFiniteGuard:
    """Skip optimizer steps with a non-finite loss (and, ``check_gradients``, gradients: not under fp16, whose
    scaler owns them) on any rank; :class:`NonFiniteTrainingError` after ``max_consecutive`` in a row."""

    max_consecutive: int = 3
    check_gradients: bool = True
    skipped: int = field(default=0, init=False)  # steps skipped in this run, for the user and the tests
    consecutive: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_consecutive, int) or isinstance(self.max_consecutive, bool):
            raise TypeError(f"max_consecutive must be an int >= 1; got {self.max_consecutive!r}.")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1 (1: stop at the first non-finite step); got"
                             f" {self.max_consecutive}.")

    def should_skip(self, loss: torch.Tensor | None, grads: Iterable[torch.Tensor], step: int) -> bool:
        """Whether every rank skips this step (one all-reduce); raises after ``max_consecutive`` in a row."""
        loss_ranks, grad_ranks = _non_finite_ranks(loss, list(grads) if self.check_gradients else [])
        if not loss_ranks and not grad_ranks:
            self.consecutive = 0
            return False
        self.skipped += 1
        self.consecutive += 1
        # Gradients are reduced across ranks, so one rank's NaN reaches every rank's gradients: name the losses.
        where = "; ".join(
            f"{what} on rank(s) {ranks}" for what, ranks in (("loss", loss_ranks), ("gradients", grad_ranks)) if ranks
        )
        if self.consecutive >= self.max_consecutive:
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
def _non_finite_ranks(loss: torch.Tensor | None, grads: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Ranks whose loss, and ranks whose gradient shards, hold an inf/NaN: each rank sets its two slots of one
    tensor, one SUM all-reduce (none on one rank) tells all, one read brings it to the host.

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
    flags = bad.view(2, 1)
    if world > 1:
        flags = torch.zeros(2, world, device=device)
        flags[:, dist.get_rank()] = bad
        dist.all_reduce(flags)  # SUM: slot r of each row is rank r's own flag
    loss_row, grad_row = flags.tolist()
    return [r for r, v in enumerate(loss_row) if v], [r for r, v in enumerate(grad_row) if v]
