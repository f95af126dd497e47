"""When and how ``ShardedEMA`` averages: pure arithmetic on step counts, no tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

EMAEvaluate = Literal["ema", "raw", "both"]
EMABuffers = Literal["average", "copy"]


@dataclass(frozen=True)
class EMAPolicy:
    """When and how :class:`~lightning_vitscale.ShardedEMA` averages the weights: its arguments of the same names
    (documented there), checked."""

    decay: float = 0.999
    warmup: bool = False
    update_every_n_steps: int = 1
    update_starting_at_step: int = 0
    buffers: EMABuffers = "average"
    evaluate: EMAEvaluate = "both"
    offload: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"`decay` must be in [0, 1]; got {self.decay}. Typical values: 0.999 to 0.9999.")
        if self.update_every_n_steps < 1:
            raise ValueError(f"`update_every_n_steps` must be >= 1; got {self.update_every_n_steps}.")
        if self.update_starting_at_step < 0:
            raise ValueError(f"`update_starting_at_step` must be >= 0; got {self.update_starting_at_step}.")
        if self.buffers not in get_args(EMABuffers):
            raise ValueError(f"`buffers` must be one of {get_args(EMABuffers)}; got {self.buffers!r}.")
        if self.evaluate not in get_args(EMAEvaluate):
            raise ValueError(f"`evaluate` must be one of {get_args(EMAEvaluate)}; got {self.evaluate!r}.")

    def should_update(self, step_idx: int) -> bool:
        return step_idx >= self.update_starting_at_step and step_idx % self.update_every_n_steps == 0

    def decay_at(self, updates_done: int) -> float:
        """The decay of the next update; 0 for the first one, which copies the weights."""
        if updates_done == 0:
            return 0.0
        return min(self.decay, (1 + updates_done) / (10 + updates_done)) if self.warmup else self.decay
