"""``blocks_per_unit=None`` with the checkpointing chosen by the user: how many consecutive blocks share one FSDP
unit, the fastest grouping whose predicted step peak fits.

FSDP runs its hooks and waits for a unit's collectives once per unit, a fixed cost that small blocks cannot
amortise (8-9 ms per unit and step on a CPU rank, benchmarks/RESULTS.md); a larger unit holds more parameters
and unsharded gradients at once. With the batch known at setup (``example_input_array``) the planner weighs both
(:mod:`.step_model`, :mod:`.step_cost`) for the checkpointing and reshard the user set; without it the recipe's
one block per unit stays. ``activation_checkpointing="auto"`` chooses the grouping with the rest of its plan
(:mod:`.plan_search`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_vitscale._utils import human_bytes
from lightning_vitscale.memory.plan_search import unit_sizes
from lightning_vitscale.memory.step_cost import DeviceRates, units_and_regather_seconds
from lightning_vitscale.memory.step_model import StepInputs, StepSettings, predict_step


@dataclass(frozen=True)
class UnitChoice:
    """The blocks per unit chosen, and what it was weighed by (for the setup summary)."""

    per_unit: int
    saved_seconds: float
    peak: int
    budget: int

    def describe(self) -> str:
        if self.per_unit == 1:
            return f"planner: no larger unit fits {human_bytes(self.budget)} or saves time"
        return (f"planner: predicted {self.saved_seconds * 1e3:.1f} ms per step less than one block per unit,"
                f" peak {human_bytes(self.peak)} of {human_bytes(self.budget)}")


def choose_blocks_per_unit(inputs: StepInputs, settings: StepSettings, budget: int, rates: DeviceRates) -> UnitChoice:
    """The unit size (:func:`~.plan_search.unit_sizes`) with the least predicted step time whose peak fits
    ``budget``, for ``settings``' checkpointing and reshard; 1 where nothing larger fits."""
    n = len(inputs.profile.blocks)

    def seconds(k: int) -> float:
        return units_and_regather_seconds(inputs, replace(settings, blocks_per_unit=k), rates)

    fitting = [k for k in unit_sizes(n, None)
               if k == 1 or predict_step(inputs, replace(settings, blocks_per_unit=k)).peak <= budget]
    best = min(fitting, key=lambda k: (seconds(k), k))
    peak = predict_step(inputs, replace(settings, blocks_per_unit=best)).peak
    return UnitChoice(best, seconds(1) - seconds(best), peak, budget)
