"""The search behind ``activation_checkpointing="auto"``: per block none / selective / full checkpointing and
per block unit reshard-after-forward or stay gathered, the least predicted extra step time within the budget.

Plans have one shape, :class:`BlockPlan`: the first ``full`` blocks fully checkpointed, the next ``selective``
ones selectively, the rest not at all; the first ``resharded`` blocks reshard after forward, the rest stay
gathered; ``per_unit`` consecutive blocks share one FSDP unit (``blocks_per_unit``: fewer units pay FSDP's
per-unit cost fewer times, at the price of more parameters and unsharded gradients alive at once).
Earliest first because a block's saved activations (and its kept parameters) live from its forward to its
backward: the first block's the longest, so it saves memory in the most phases of the step. The blocks of
one model are alike, so which of them is changed matters only through that order.

The search is exact over that shape, by the predicted peak (:mod:`.step_model`) and extra step time
(:mod:`.step_cost`): for every number of fully checkpointed blocks and of resharded ones, the fewest selective
blocks that fit (memory only falls as a block goes from none to selective, or from gathered to resharded, so a
two-pointer walk finds them with about 2 n^2 predictions: well under a second for 48 blocks); of those, the
fastest. When the search may choose ``per_unit`` too, it repeats that for each candidate (:func:`unit_sizes`: the
smallest size for each number of units, up to :data:`MAX_BLOCKS_PER_UNIT`) and keeps the fastest. Where the
budget cannot be met at all, the plan is the one with the least memory (every block fully checkpointed and
resharded) and the caller warns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_vitscale.memory.step_cost import (
    DeviceRates,
    recompute_seconds,
    tensor_parallel_seconds,
    units_and_regather_seconds,
)
from lightning_vitscale.memory.step_model import StepInputs, StepSettings, predict_step

BlockMode = Literal["full", "selective"]
MAX_BLOCKS_PER_UNIT = 8
"""The largest unit the search builds: 8 blocks per unit already pay at most 1/8 of the per-unit cost."""


@dataclass(frozen=True)
class BlockPlan:
    """First ``full`` blocks fully checkpointed, the next ``selective`` selectively; first ``resharded`` blocks
    reshard after forward, the rest stay gathered (a unit that holds any of the first ``resharded`` reshards);
    ``per_unit`` consecutive blocks per FSDP unit."""

    full: int = 0
    selective: int = 0
    resharded: int = 0
    per_unit: int = 1

    def settings(self, n: int, offload: bool = False) -> StepSettings:
        return StepSettings(
            checkpointed=frozenset(range(self.full + self.selective)),
            selective=frozenset(range(self.full, self.full + self.selective)),
            kept_gathered=frozenset(range(self.resharded, n)),
            offload=offload,
            blocks_per_unit=self.per_unit,
        )

    def mode(self, index: int) -> BlockMode | None:
        """Block ``index``'s checkpointing: ``"full"``, ``"selective"`` or ``None``."""
        if index < self.full:
            return "full"
        return "selective" if index < self.full + self.selective else None

    def describe(self, n: int) -> str:
        kept = n - self.resharded
        units = f", {self.per_unit} blocks per unit" if self.per_unit > 1 else ""
        return (f"{self.full} full + {self.selective} selective of {n} blocks checkpointed,"
                f" {kept} of {n} kept gathered for backward{units}")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may change: ``fixed_reshard`` pins every block's reshard (``True``: the user asked for
    resharding, as the recipe; ``None``: the search chooses per block); ``per_unit`` pins the blocks per unit
    (the user's ``blocks_per_unit``, or one already applied) or, ``None``, lets the search choose it."""

    inputs: StepInputs
    budget: int
    rates: DeviceRates
    offload: bool = False
    fixed_reshard: bool | None = None
    per_unit: int | None = 1

    @property
    def n(self) -> int:
        return len(self.inputs.profile.blocks)

    def seconds(self, plan: BlockPlan) -> float:
        """Predicted extra time per step of ``plan`` over no checkpointing with every block gathered, plus what
        its FSDP units cost by their number."""
        inputs = self.inputs
        recompute = sum(recompute_seconds(b, plan.mode(i), self.rates, inputs.batch_scale)
                        for i, b in enumerate(inputs.profile.blocks))
        # Tensor parallelism's recompute all-reduces only: the forward and backward ones are in every plan.
        tensor = (tensor_parallel_seconds(inputs, [plan.mode(i) for i in range(self.n)], self.rates)
                  - tensor_parallel_seconds(inputs, [None] * self.n, self.rates))
        return recompute + tensor + units_and_regather_seconds(inputs, plan.settings(self.n), self.rates)

    def fits(self, plan: BlockPlan) -> bool:
        return predict_step(self.inputs, plan.settings(self.n, self.offload)).peak <= self.budget


def unit_sizes(n: int, pinned: int | None) -> list[int]:
    """Blocks per unit to try: ``pinned`` alone, or the smallest size for each number of units up to
    :data:`MAX_BLOCKS_PER_UNIT` blocks per unit (a larger size with as many units only holds more at once)."""
    if pinned is not None:
        return [pinned]
    sizes: dict[int, int] = {}
    for k in range(1, max(1, min(n, MAX_BLOCKS_PER_UNIT)) + 1):
        sizes.setdefault(-(-n // k) if n else 1, k)
    return sorted(sizes.values())


def reshard_boundaries(n: int, per_unit: int) -> list[int]:
    """How many first blocks may reshard with ``per_unit`` blocks per unit, most first: whole units only (a unit
    reshards if any of its blocks does). The one encoding of "which units stay gathered": ``"auto"``'s search and
    the grouping under the user's checkpointing (:mod:`.unit_choice`) both walk these."""
    return sorted({min(n, u * per_unit) for u in range(-(-n // per_unit) + 1)}, reverse=True)


def least_memory(space: SearchSpace) -> BlockPlan:
    """Every block fully checkpointed and resharded (unless reshard is pinned to keeping), one block per unit
    (unless pinned)."""
    resharded = 0 if space.fixed_reshard is False else space.n
    return BlockPlan(space.n, 0, resharded, space.per_unit or 1)


def search(space: SearchSpace) -> BlockPlan:
    """The plan with the least predicted extra time whose predicted peak fits (see the module docstring)."""
    fallback = least_memory(space)
    if not space.fits(fallback):
        return fallback  # nothing fits: the caller warns
    plans = [_search_units(space, k) for k in unit_sizes(space.n, space.per_unit)]
    return min((p for p in plans if p is not None), key=space.seconds, default=fallback)


def _search_units(space: SearchSpace, per_unit: int) -> BlockPlan | None:
    """The fastest plan that fits with ``per_unit`` blocks per unit (``None``: none fits)."""
    n = space.n
    boundaries = reshard_boundaries(n, per_unit)
    reshards = [n] if space.fixed_reshard else [0] if space.fixed_reshard is False else boundaries
    best: BlockPlan | None = None
    for full in range(n + 1):
        selective = 0
        for resharded in reshards:  # fewer resharded blocks: more memory, so at least as many selective ones
            while full + selective <= n and not space.fits(BlockPlan(full, selective, resharded, per_unit)):
                selective += 1
            if full + selective > n:
                break  # no fewer resharded blocks fit with this many full ones either
            plan = BlockPlan(full, selective, resharded, per_unit)
            if best is None or space.seconds(plan) < space.seconds(best):
                best = plan
    return best
