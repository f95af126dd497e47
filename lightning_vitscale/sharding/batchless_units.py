"""The units where no measured step can choose them: no batch at setup (streamed data) or a step the planner cannot
run on fake tensors. From sizes alone: one rank keeps every block gathered in one unit; several group consecutive
blocks by the collectives' cost; the default's recipe plan (every block checkpointed) takes the same units.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lightning_vitscale._utils import human_bytes
from lightning_vitscale.distributed import RankContext
from lightning_vitscale.distributed.mesh import shard_size
from lightning_vitscale.memory import rates_for
from lightning_vitscale.memory.collectives import ring_bytes
from lightning_vitscale.memory.plan_search import BlockPlan
from lightning_vitscale.precision import PrecisionPolicy
from lightning_vitscale.sharding.parallelize import select_units
from lightning_vitscale.sharding.resolved import ResolvedConfig
from lightning_vitscale.sharding.settings import ShardingPolicy


def recipe_units(
    module: nn.Module, resolved: ResolvedConfig, precision: PrecisionPolicy, ranks: RankContext, budget: int,
    blocks: BlockPlan,
) -> tuple[BlockPlan, str | None, bool]:
    """The recipe's plan where the default's step could not be measured (every block checkpointed), why, and whether
    one rank keeps every block: there in one unit on compute copies (units of their own shard nothing, and a second
    forward in a step, a GAN's, cannot run on them). On several ranks the recipe's unit per block stays: grouping
    them would be a guess from the structure that no step ran first (HF Mask2Former's grouped units failed on
    resharded weights before units kept to one container), and this plan is the memory-first fallback."""
    n = blocks.n
    keeps = one_rank_keeps(module, resolved, precision, ranks, budget, UNMEASURED)
    if keeps is not None:  # no unit resharded, every block in one
        return BlockPlan.prefix(n, n, 0, 0, max(n, 1)), keeps, True
    return blocks, None, False


# One rank without a batch at setup keeps every block's compute copy gathered when the copies take at most this share
# of the memory budget: the model state (fp32 weights, gradients, AdamW's two moments: 8x a bf16 copy) then fits in
# half of it, and the first step's plan keeps the rest for activations (checkpointing blocks where they do not fit).
KEPT_COPIES_SHARE = 1 / 16


NO_BATCH = "no batch at setup to plan units with"
UNMEASURED = "its step not measured"


def one_rank_keeps(
    module: nn.Module, resolved: ResolvedConfig, precision: PrecisionPolicy, ranks: RankContext, budget: int,
    why: str = NO_BATCH,
) -> str | None:
    """Why one rank keeps every block gathered (one unit, the step on compute copies: ``steps.apply_fsdp``) when no
    batch is known at setup to plan the units with (or its step cannot run on fake tensors), or ``None``. One rank
    shards nothing: a block's unit of its own only frees its compute copy after forward, for a gather and FSDP2's
    hooks per unit and step (the GPU runs: 13 units made ViT-B/16's step host-bound where the data loader gave setup
    no batch). ``priority="memory"``, a pinned ``reshard_after_forward`` or ``blocks_per_unit``, offload and tensor
    parallelism keep the units."""
    if ranks.world_size > 1 or ranks.tensor_mesh is not None or not (resolved.planner_keeps and resolved.planner_units):
        return None
    if offloads(resolved.sharding, ranks.device):
        return None
    copies = sum(p.numel() for p in module.parameters()) * precision.compute.itemsize
    if copies > budget * KEPT_COPIES_SHARE:
        return None
    return (f"one rank, {why}: every block kept gathered, its compute copies"
            f" {human_bytes(copies)} (at most 1/{round(1 / KEPT_COPIES_SHARE)} of the {human_bytes(budget)} budget)")


def several_ranks_units(
    module: nn.Module, resolved: ResolvedConfig, precision: PrecisionPolicy, ranks: RankContext, budget: int,
    why: str = NO_BATCH,
) -> tuple[ResolvedConfig, str | None]:
    """Several data-parallel ranks and no batch at setup to plan the units with (or a step fake tensors cannot
    follow, ``why``): consecutive blocks grouped into
    units by the collectives' cost alone (the batch's compute is unknown), and why; else ``resolved`` unchanged and
    ``None``. Each unit costs its hooks (``unit_s`` a step); a larger unit exposes more of the first all-gather and
    the last reduce-scatter, which nothing overlaps: the blocks per unit minimise the sum, with two units' gathered
    compute copies (the one running, the one prefetched) at most 1/16 of the budget. On this CPU's gloo rates it
    picks what the planner's search picks with a batch (2 blocks per unit for the demo ViT, 4 for timm's
    ``vit_tiny``; benchmarks/RESULTS.md: timm's step 1.25x DDP's with a unit per block, 1.11x so). Units kept
    gathered stay the first step's choice (``"auto"``); ``priority="memory"``, pinned units, offload and tensor
    parallelism keep a unit per block."""
    if ranks.world_size == 1 or ranks.tensor_mesh is not None or not resolved.planner_units or offloads(
            resolved.sharding, ranks.device):
        return resolved, None
    blocks = [block for _, unit in select_units(module, resolved.sharding.blocks) for _, block in unit]
    sizes = [sum(p.numel() for p in block.parameters()) * precision.compute.itemsize for block in blocks]
    rates, shard = rates_for(ranks.device), shard_size(ranks.sharding_mesh)

    def largest_unit(k: int) -> int:
        return max(sum(sizes[i:i + k]) for i in range(0, len(sizes), k))

    def seconds(k: int) -> float:
        exposed = ring_bytes(largest_unit(k), shard) / rates.link_bytes_per_s + rates.latency_s
        return -(-len(sizes) // k) * rates.unit_s + 2 * exposed

    fits = [k for k in range(1, len(sizes) + 1) if 2 * largest_unit(k) <= budget * KEPT_COPIES_SHARE]
    k = min(fits, key=seconds, default=1)
    if k == 1:
        return resolved, None
    return dataclasses.replace(resolved, blocks_per_unit=k), (
        f"{why}: from the collectives alone, predicted"
        f" {seconds(k) * 1e3:.1f} ms a step of per-unit hooks and exposed first gather and last reduction, against"
        f" {seconds(1) * 1e3:.1f} ms with a unit per block")


def offloads(sharding: ShardingPolicy, device: torch.device) -> bool:
    """Whether the sharded state leaves the device (``offload="cpu"`` on a CPU rank changes nothing)."""
    return sharding.offload is not None and device.type != "cpu"
