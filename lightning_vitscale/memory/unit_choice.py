"""``blocks_per_unit=None`` with the checkpointing chosen by the user: how many consecutive blocks share one FSDP
unit, and (``reshard_after_forward=None``) which units keep their gathered parameters for backward: the fastest
such plan whose predicted step peak fits.

FSDP runs its hooks and waits for a unit's collectives once per unit, a fixed cost that small blocks cannot
amortise (8-9 ms per unit and step on a CPU rank, benchmarks/RESULTS.md); a larger unit holds more parameters
and unsharded gradients at once. With the batch known at setup (``example_input_array``) the planner weighs both
(:mod:`.step_model`, :mod:`.step_cost`) for the checkpointing and reshard the user set; without it the recipe's
one block per unit stays. A unit kept gathered saves its second all-gather in backward (on CPU ranks, where
gloo's threads share the cores with compute, it is not hidden: benchmarks/RESULTS.md) at the cost of its
parameters held from its forward to its backward; as under ``"auto"``, the last units are the ones kept (their
backward comes first). ``activation_checkpointing="auto"`` chooses the grouping with the rest of its plan
(:mod:`.plan_search`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_vitscale._utils import human_bytes
from lightning_vitscale.memory.plan_search import reshard_boundaries, unit_sizes
from lightning_vitscale.memory.step_cost import DeviceRates, units_and_regather_seconds
from lightning_vitscale.memory.step_model import StepInputs, StepSettings, predict_step, unit_spans


@dataclass(frozen=True)
class UnitChoice:
    """The blocks per unit and the units kept gathered chosen, and what they were weighed by (for the summary).

    ``resharded``: the first blocks that reshard after forward as the user's setting has it, the rest (whole last
    units) kept gathered for backward: :class:`~.plan_search.BlockPlan`'s encoding (``blocks`` where the user's
    reshard is fixed, or nothing fits). ``saved_seconds``: against one block per unit, every unit as the user's
    reshard setting has it.
    """

    per_unit: int
    saved_seconds: float
    peak: int
    budget: int
    resharded: int
    blocks: int

    @property
    def units(self) -> int:
        return len(unit_spans(self.blocks, self.per_unit))

    @property
    def kept_units(self) -> int:
        """How many of the last units keep their gathered parameters for backward."""
        return self.units - -(-self.resharded // self.per_unit)

    def kept_gathered(self, n: int | None = None) -> frozenset[int]:
        """The blocks whose unit stays gathered from forward to backward."""
        return frozenset(range(self.resharded, self.blocks if n is None else n))

    def describe(self) -> str:
        if self.per_unit == 1 and self.kept_units == 0:
            return f"planner: no larger unit fits {human_bytes(self.budget)} or saves time"
        kept = f", {self.kept_units} of {self.units} units kept gathered for backward" if self.kept_units else ""
        return (f"planner{kept}: predicted {self.saved_seconds * 1e3:.1f} ms per step less than one block per unit,"
                f" peak {human_bytes(self.peak)} of {human_bytes(self.budget)}")


def choose_blocks_per_unit(
    inputs: StepInputs,
    settings: StepSettings,
    budget: int,
    rates: DeviceRates,
    may_keep: bool = False,
    per_unit: int | None = None,
) -> UnitChoice:
    """The unit size (:func:`~.plan_search.unit_sizes`, or ``per_unit``) and, where ``may_keep`` (the user left
    ``reshard_after_forward`` to the planner) and blocks reshard, how many first blocks reshard (whole units,
    :func:`~.plan_search.reshard_boundaries`; the last units stay gathered), with the least predicted step time
    whose peak fits ``budget``; ties go to less memory. One block per unit, nothing kept, where nothing else fits."""
    n = len(inputs.profile.blocks)

    def planned(k: int, r: int) -> StepSettings:
        return replace(settings, blocks_per_unit=k, kept_gathered=settings.kept_gathered | frozenset(range(r, n)))

    def seconds(k: int, r: int) -> float:
        return units_and_regather_seconds(inputs, planned(k, r), rates)

    keeping = may_keep and settings.reshard_after_forward
    candidates = [(k, r) for k in unit_sizes(n, per_unit) for r in (reshard_boundaries(n, k) if keeping else [n])]
    baseline = (per_unit or 1, n)
    fitting = [c for c in candidates if c == baseline or predict_step(inputs, planned(*c)).peak <= budget]
    best_k, best_r = min(fitting, key=lambda c: (seconds(*c), -c[1], c[0]))
    peak = predict_step(inputs, planned(best_k, best_r)).peak
    return UnitChoice(best_k, seconds(1, n) - seconds(best_k, best_r), peak, budget, best_r, n)
