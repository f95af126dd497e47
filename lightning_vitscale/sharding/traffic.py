"""The bytes each rank sends per training step, inside its node and across nodes, for a layout.

From the FSDP units' parameter shapes, the precision's dtypes and the mesh, through the planner's one model of a
unit's collectives (``memory/collectives.py``). Conventions, so numbers compare across layouts: one forward and one
backward per optimizer step; a collective whose group spans nodes counts in full as across-node traffic (a ring
moves every byte at the pace of its inter-node hops); fp32 norms add one all-reduce per mesh dimension. Under
tensor parallelism (innermost, inside a node) the above counts the data-parallel ranks; the tensor-parallel
all-reduces of activations depend on the batch: the planner predicts them (``memory/tensor_split.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard

from lightning_vitscale._compat import unit_keeps_gathered
from lightning_vitscale._utils import mib
from lightning_vitscale.memory.collectives import ring_bytes, unit_collectives
from lightning_vitscale.precision import PrecisionPolicy
from lightning_vitscale.sharding.settings import unit_reshard
from lightning_vitscale.sharding.unit_members import modules_outside_units


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one rank sends per step: to ranks of its own node, and over collectives that span nodes."""

    intra_node: int
    inter_node: int

    def describe(self) -> str:
        return f"{mib(self.intra_node, 2)} within the node, {mib(self.inter_node, 2)} across nodes"


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the unsharded shapes of the parameters it shards, and whether it reshards after forward."""

    shapes: tuple[torch.Size, ...]
    reshard_after_forward: bool | int


def fsdp_units(outer: nn.Module, ignored: set[nn.Parameter], reshard_after_forward: bool | int | None) -> list[Unit]:
    """The units under ``outer`` (itself one), with the parameters each one shards (not its nested units')."""
    units = []
    for module in outer.modules():
        if isinstance(module, FSDPModule):
            own = [p for m in modules_outside_units(module) for p in m.parameters(recurse=False) if p not in ignored]
            reshard = unit_reshard(reshard_after_forward, module is outer)
            if unit_keeps_gathered(module):  # the planner's choice for this unit (set after the request)
                reshard = False
            units.append(Unit(tuple(tensor_parallel_shape(p) for p in own), reshard))
    return units


def tensor_parallel_shape(param: nn.Parameter) -> torch.Size:
    """What FSDP shards of ``param``: its shape, or under tensor parallelism one tensor-parallel rank's share."""
    mesh = getattr(param, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is None or "tensor_parallel" not in names:
        return param.shape
    dim = names.index("tensor_parallel")
    placement = param.placements[dim]  # type: ignore[attr-defined]
    shape = list(param.shape)
    if isinstance(placement, Shard):
        shape[placement.dim] //= mesh.size(dim)
    return torch.Size(shape)


def step_traffic(
    units: list[Unit], norm_numel: int, precision: PrecisionPolicy, world_size: int, shard_size: int,
    ranks_per_node: int, rank: int,
) -> StepTraffic:
    """Bytes ``rank`` sends per step for shard groups of ``shard_size`` consecutive ranks (replicas across them)."""
    start = rank - rank % shard_size
    shard_group = list(range(start, start + shard_size))
    replica_group = list(range(rank % shard_size, world_size, shard_size))
    sent_by = {False: 0.0, True: 0.0}  # across nodes?

    def add(group: list[int], sent: float) -> None:
        if len(group) > 1:
            sent_by[len({r // ranks_per_node for r in group}) > 1] += sent

    for unit in units:
        for collective in unit_collectives(
            unit.shapes, shard=shard_size, replicas=len(replica_group), gather_itemsize=precision.compute.itemsize,
            reduce_itemsize=precision.reduce.itemsize, reshard=unit.reshard_after_forward,
        ):
            size = collective.ranks  # the reshard group: this rank's block of that size inside its shard group
            sub = start + (rank - start) // size * size
            groups = {"shard": shard_group, "replicate": replica_group, "reshard": list(range(sub, sub + size))}
            add(groups[collective.group], collective.sent)
    if norm_numel:
        add(shard_group, ring_bytes(norm_numel * 4, len(shard_group), reduce=True))
        add(replica_group, ring_bytes(norm_numel * 4, len(replica_group), reduce=True))
    return StepTraffic(round(sent_by[False]), round(sent_by[True]))


@dataclass(frozen=True)
class LayoutReport:
    """What the setup summary says about the layout: its name, this rank's traffic, and hybrid's for contrast."""

    sharding: str
    traffic: StepTraffic
    hybrid_traffic: StepTraffic | None
    tensor_parallel: int = 1
    tensor_sent: float | None = None  # bytes per step over the tensor-parallel dimension, predicted for a batch

    def describe(self) -> str:
        """The summary's traffic line: by node, and under tensor parallelism by mesh dimension."""
        if self.tensor_parallel == 1:
            return f"{self.traffic.describe()} (sent by this rank)"
        tensor = ("not predicted (no batch known at setup)" if self.tensor_sent is None else
                  f"{mib(self.tensor_sent, 2)} within the node (all-reduces of activations, predicted for the"
                  " planner's batch)")
        return (f"data parallel {self.traffic.describe()}; tensor parallel {tensor} (sent by this rank)")


def layout_report(
    outer: nn.Module, norm_params: list[nn.Parameter], precision: PrecisionPolicy,
    reshard_after_forward: bool | int | None, world_size: int, shard_size: int, ranks_per_node: int, rank: int,
    tensor_parallel: int = 1, tensor_sent: float | None = None,
) -> LayoutReport:
    """Traffic of the chosen layout; on a fully sharded multi-node job also what ``sharding="hybrid"`` would send.
    ``world_size``, ``shard_size`` and ``rank`` count data-parallel ranks, ``ranks_per_node`` all ranks."""
    ranks_per_node = max(1, ranks_per_node // tensor_parallel)
    units = fsdp_units(outer, set(norm_params), reshard_after_forward)
    norm_numel = sum(p.numel() for p in norm_params)

    def traffic(shard: int) -> StepTraffic:
        return step_traffic(units, norm_numel, precision, world_size, shard, ranks_per_node, rank)

    replicas = world_size // shard_size
    name = "full" if replicas == 1 else f"hybrid ({replicas} replicas x {shard_size}-rank shard groups)"
    multi_node = world_size > ranks_per_node and world_size % ranks_per_node == 0
    contrast = traffic(ranks_per_node) if multi_node and shard_size != ranks_per_node else None
    return LayoutReport(name, traffic(shard_size), contrast, tensor_parallel, tensor_sent)
