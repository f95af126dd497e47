"""The planner's one search: per block none / selective / full checkpointing, per unit reshard or stay gathered,
and blocks per FSDP unit, each chosen or pinned (:class:`SearchSpace`): the least predicted step time that fits.

Plans have one shape, :class:`BlockPlan`: checkpointing earliest first (the first block's activations live
longest), the first ``resharded`` blocks resharded. Exact over that shape: per unit size and number of full and of
resharded blocks, the fewest selective ones that fit (a bisection, then a two-pointer walk: memory only falls as
blocks go selective or resharded); of those, the fastest. Bounds end a walk early: a tight budget on 32 blocks
takes about 2,000 predictions (3 s on a loaded 2-core CPU). Where nothing fits, the least memory plan (the caller
warns); the recipe's plan is in every unpinned space, so a chosen plan fits wherever the recipe's would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

from lightning_vitscale.discovery.unit_runs import spans_of
from lightning_vitscale.memory.step_cost import (
    DeviceRates,
    recompute_seconds,
    tensor_parallel_seconds,
    units_and_regather_seconds,
)
from lightning_vitscale.memory.step_inputs import StepInputs, StepSettings, unit_spans
from lightning_vitscale.memory.step_model import predict_step

BlockMode = Literal["full", "selective"]
Modes = tuple[BlockMode | None, ...]


@dataclass(frozen=True)
class BlockPlan:
    """Each block's checkpointing (``None``: none); the first ``resharded`` blocks (whole units) reshard after
    forward, the rest stay gathered; up to ``per_unit`` consecutive blocks per FSDP unit, each unit's first block in
    ``starts`` (as setup makes them, :func:`.step_inputs.unit_spans`; empty: runs of ``per_unit``)."""

    modes: Modes = ()
    resharded: int = 0
    per_unit: int = 1
    starts: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def prefix(cls, n: int, full: int, selective: int = 0, resharded: int = 0, per_unit: int = 1) -> BlockPlan:
        """The chosen checkpointing's shape: the first ``full`` of ``n`` blocks fully, the next ``selective``."""
        modes: Modes = tuple("full" if i < full else "selective" if i < full + selective else None for i in range(n))
        return cls(modes, resharded, per_unit)

    @property
    def n(self) -> int:
        return len(self.modes)

    def settings(self, offload: bool = False) -> StepSettings:
        return StepSettings(
            checkpointed=frozenset(i for i, mode in enumerate(self.modes) if mode is not None),
            selective=frozenset(i for i, mode in enumerate(self.modes) if mode == "selective"),
            kept_gathered=frozenset(range(self.first_kept, self.n)),
            offload=offload,
            blocks_per_unit=self.per_unit,
        )

    @property
    def unit_starts(self) -> tuple[int, ...]:
        return self.starts or tuple(span.start for span in spans_of(self.n, self.per_unit))

    @property
    def first_kept(self) -> int:
        """The first block of the first unit after the resharded blocks (FSDP reshards whole units)."""
        return next((start for start in self.unit_starts if start >= self.resharded), self.n)

    @property
    def units(self) -> int:
        return len(self.unit_starts)

    @property
    def kept_units(self) -> int:
        """How many of the last units keep their gathered parameters for backward."""
        return sum(start >= self.resharded for start in self.unit_starts)

    def describe(self) -> str:
        n, full, selective = self.n, self.modes.count("full"), self.modes.count("selective")
        plain = self.unit_starts == tuple(span.start for span in spans_of(n, self.per_unit))
        units = (", all in one unit" if self.units == 1 and n > 1 else "" if self.per_unit == 1
                 else f", {self.per_unit} blocks per unit" if plain
                 else f", up to {self.per_unit} blocks per unit (where the step runs them back to back)")
        return (f"{full} full + {selective} selective of {n} blocks checkpointed,"
                f" {self.kept_units} of {self.units} units kept gathered for backward{units}")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may change: ``modes``, ``fixed_reshard`` (every unit's) and ``per_unit`` pin; ``None`` frees."""

    inputs: StepInputs
    budget: int
    rates: DeviceRates
    offload: bool = False
    fixed_reshard: bool | None = None
    per_unit: int | None = 1
    modes: Modes | None = None

    @property
    def n(self) -> int:
        return len(self.inputs.profile.blocks)

    @cached_property
    def selective_runs(self) -> bool:
        """Whether every block can run selectively: one that mutates an output selective checkpointing keeps
        cannot (measured so), and a plan's selective blocks are a run of them."""
        return all("selective" in block.modes for block in self.inputs.profile.blocks)

    def seconds(self, plan: BlockPlan) -> float:
        """Predicted time per step of ``plan`` beyond no checkpointing with every block gathered, units' cost in."""
        inputs = self.inputs
        recompute = sum(recompute_seconds(b, plan.modes[i], self.rates, inputs.batch_scale)
                        for i, b in enumerate(inputs.profile.blocks))
        # Tensor parallelism's recompute all-reduces only: the forward and backward ones are in every plan.
        tensor = (tensor_parallel_seconds(inputs, list(plan.modes), self.rates)
                  - tensor_parallel_seconds(inputs, [None] * self.n, self.rates))
        return recompute + tensor + units_and_regather_seconds(inputs, plan.settings(), self.rates)

    def peak(self, plan: BlockPlan) -> int:
        return predict_step(self.inputs, plan.settings(self.offload)).peak

    def fits(self, plan: BlockPlan) -> bool:
        return self.peak(plan) <= self.budget

    def plan(self, full: int, selective: int, resharded: int, per_unit: int) -> BlockPlan:
        plan = (BlockPlan(self.modes, resharded, per_unit) if self.modes is not None
                else BlockPlan.prefix(self.n, full, selective, resharded, per_unit))
        return replace(plan, starts=tuple(span.start for span in unit_spans(self.inputs, plan.settings())))

    def reshards(self, per_unit: int) -> list[int]:
        if self.fixed_reshard is not None:
            return [self.n if self.fixed_reshard else 0]
        return reshard_boundaries(unit_spans(self.inputs, StepSettings(blocks_per_unit=per_unit)), self.n)


def unit_sizes(n: int, pinned: int | None) -> list[int]:
    """Blocks per unit to try: ``pinned``, or the smallest size for each number of units (about 2 sqrt(n) sizes)."""
    if pinned is not None:
        return [pinned]
    return sorted({-(-n // units) for units in range(1, n + 1)}) if n else [1]


def reshard_boundaries(spans: Sequence[range], n: int) -> list[int]:
    """How many first blocks may reshard, most first: whole units (``spans``, of ``n`` blocks) only."""
    return sorted({*(span.start for span in spans), n}, reverse=True)


def least_memory(space: SearchSpace) -> BlockPlan:
    """The recipe's plan, as far as not pinned: every block full, resharded, its own unit."""
    return space.plan(space.n, 0, space.reshards(1)[0], space.per_unit or 1)


def fits_unchecked(space: SearchSpace, pinned: int | None = None) -> bool:
    """Whether every plan of ``space`` fits with no block checkpointed (its unit sizes, and ``pinned``'s, each with
    the fewest blocks resharded: the most memory). Then no checkpointing is the fastest plan of each unit layout (a
    checkpointed plan only adds recompute to the same units' cost), so the checkpointed modes need not be measured."""
    sizes = {*unit_sizes(space.n, space.per_unit), *([pinned] if pinned is not None else [])}
    return all(space.fits(BlockPlan((None,) * space.n, space.reshards(k)[-1], k)) for k in sorted(sizes))


def search(space: SearchSpace) -> BlockPlan:
    """The plan with the least predicted step time whose predicted peak fits (see the module docstring)."""
    best = least_memory(space)
    if not space.fits(best):
        return best  # nothing fits: the caller warns

    def beats(plan: BlockPlan) -> bool:
        return space.seconds(plan) < space.seconds(best)

    def fastest(per_unit: int) -> float:  # nothing checkpointed or resharded that is not pinned
        return space.seconds(space.plan(0, 0, space.reshards(per_unit)[-1], per_unit))

    for per_unit in sorted(unit_sizes(space.n, space.per_unit), key=fastest):  # promising sizes first: more skipped
        for plan in _fitting(space, per_unit, beats):
            if beats(plan):
                best = plan
    return best


def _fitting(space: SearchSpace, per_unit: int, beats: Callable[[BlockPlan], bool]) -> Iterator[BlockPlan]:
    """Per number of full blocks (pinned modes: once) and of resharded ones, the fitting plan with the fewest
    selective blocks; until none with as many full blocks ``beats`` the best found."""
    n, reshards = space.n, space.reshards(per_unit)
    for full in range(n + 1) if space.modes is None else [0]:
        if not beats(space.plan(full, 0, reshards[-1], per_unit)):
            return
        selective = _fewest_selective(space, full, reshards[0], per_unit)
        for resharded in reshards:  # fewer resharded: more memory, so at least as many selective
            if not beats(space.plan(full, selective, reshards[-1], per_unit)):
                break  # no later plan of this walk beats the best: each has as many selective blocks or more
            while full + selective <= n and not space.fits(space.plan(full, selective, resharded, per_unit)):
                if space.modes is not None:
                    return  # pinned modes: no fewer resharded blocks fit either
                selective += 1 if space.selective_runs else n + 1
            if full + selective > n:
                break  # no fewer resharded blocks fit with this many full ones either
            yield space.plan(full, selective, resharded, per_unit)


def _fewest_selective(space: SearchSpace, full: int, resharded: int, per_unit: int) -> int:
    """The fewest selective blocks after ``full`` ones that fit (``n - full + 1``: none), by bisection."""
    if space.modes is not None:
        return 0
    if not space.selective_runs:
        return 0 if space.fits(space.plan(full, 0, resharded, per_unit)) else space.n - full + 1
    low, high = 0, space.n - full + 1
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if space.fits(space.plan(full, middle, resharded, per_unit)) else (middle + 1, high)
    return low
