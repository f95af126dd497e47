"""The search behind ``activation_checkpointing="auto"``: per block none / selective / full checkpointing and
per block unit reshard-after-forward or stay gathered, the least predicted extra step time within the budget.

Plans have one shape, :class:`BlockPlan`: the first ``full`` blocks fully checkpointed, the next ``selective``
ones selectively, the rest not at all; the first ``resharded`` blocks reshard after forward, the rest stay
gathered. Earliest first because a block's saved activations (and its kept parameters) live from its forward to
its backward: the first block's the longest, so it saves memory in the most phases of the step. The blocks of
one model are alike, so which of them is changed matters only through that order.

The search is exact over that shape, by the predicted peak (:mod:`.step_model`) and extra step time
(:mod:`.step_cost`): for every number of fully checkpointed blocks and of resharded ones, the fewest selective
blocks that fit (memory only falls as a block goes from none to selective, or from gathered to resharded, so a
two-pointer walk finds them with about 2 n^2 predictions: well under a second for 48 blocks); of those, the
fastest. Where the budget cannot be met at all, the plan is the one with the least memory (every block fully
checkpointed and resharded) and the caller warns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lightning_vitscale.memory.step_cost import DeviceRates, recompute_seconds, regather_seconds
from lightning_vitscale.memory.step_model import StepInputs, StepSettings, predict_step

BlockMode = Literal["full", "selective"]


@dataclass(frozen=True)
class BlockPlan:
    """First ``full`` blocks fully checkpointed, the next ``selective`` selectively; first ``resharded`` blocks
    reshard after forward, the rest stay gathered."""

    full: int = 0
    selective: int = 0
    resharded: int = 0

    def settings(self, n: int, offload: bool = False) -> StepSettings:
        return StepSettings(
            checkpointed=frozenset(range(self.full + self.selective)),
            selective=frozenset(range(self.full, self.full + self.selective)),
            kept_gathered=frozenset(range(self.resharded, n)),
            offload=offload,
        )

    def mode(self, index: int) -> BlockMode | None:
        """Block ``index``'s checkpointing: ``"full"``, ``"selective"`` or ``None``."""
        if index < self.full:
            return "full"
        return "selective" if index < self.full + self.selective else None

    def describe(self, n: int) -> str:
        kept = n - self.resharded
        return (f"{self.full} full + {self.selective} selective of {n} blocks checkpointed,"
                f" {kept} of {n} kept gathered for backward")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may change: ``fixed_reshard`` pins every block's reshard (``True``: the user asked for
    resharding, as the recipe; ``None``: the search chooses per block)."""

    inputs: StepInputs
    budget: int
    rates: DeviceRates
    offload: bool = False
    fixed_reshard: bool | None = None

    @property
    def n(self) -> int:
        return len(self.inputs.profile.blocks)

    def seconds(self, plan: BlockPlan) -> float:
        """Predicted extra time per step of ``plan`` over no checkpointing with every block gathered."""
        inputs, c = self.inputs, self.inputs.compute.itemsize
        blocks = inputs.profile.blocks
        recompute = sum(recompute_seconds(b, plan.mode(i), self.rates, inputs.batch_scale)
                        for i, b in enumerate(blocks))
        gathered = [sum(math.prod(s) for s in shapes) * c for shapes in inputs.layout.blocks]
        return recompute + sum(regather_seconds(gathered[i], inputs.world, self.rates)
                               for i in range(plan.resharded))

    def fits(self, plan: BlockPlan) -> bool:
        return predict_step(self.inputs, plan.settings(self.n, self.offload)).peak <= self.budget


def least_memory(space: SearchSpace) -> BlockPlan:
    """Every block fully checkpointed and resharded (unless reshard is pinned to keeping)."""
    return BlockPlan(space.n, 0, 0 if space.fixed_reshard is False else space.n)


def search(space: SearchSpace) -> BlockPlan:
    """The plan with the least predicted extra time whose predicted peak fits (see the module docstring)."""
    n = space.n
    fallback = least_memory(space)
    if not space.fits(fallback):
        return fallback  # nothing fits: the caller warns
    reshards = [n] if space.fixed_reshard else [0] if space.fixed_reshard is False else list(range(n, -1, -1))
    best = fallback
    for full in range(n + 1):
        selective = 0
        for resharded in reshards:  # fewer resharded blocks: more memory, so at least as many selective ones
            while full + selective <= n and not space.fits(BlockPlan(full, selective, resharded)):
                selective += 1
            if full + selective > n:
                break  # no fewer resharded blocks fit with this many full ones either
            plan = BlockPlan(full, selective, resharded)
            if space.seconds(plan) < space.seconds(best):
                best = plan
    return best
