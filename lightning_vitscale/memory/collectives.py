"""The one model of an FSDP unit's collectives: which a step runs, over which group, and the bytes each rank sends
(timed by :mod:`.step_cost`, added up by the setup summary's traffic report, ``sharding/traffic.py``).

Each is a ring over its ``n`` ranks (a ``B``-byte all-gather or reduce-scatter sends ``B (n - 1) / n`` per rank,
an all-reduce twice that) on the unit's parameters, dim 0 padded to the shard group (FSDP2's chunks). Per unit and
step: an all-gather in forward, another in backward where the unit resharded (over the shard group, or an ``int``
reshard's smaller group), a reduce-scatter of the gradients and, with replicas, an all-reduce across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_vitscale._utils import shard_numel

Group = Literal["shard", "reshard", "replicate"]


@dataclass(frozen=True)
class Collective:
    """One collective of one unit in one step: ``sent`` bytes per rank over a group of ``ranks``."""

    kind: Literal["all_gather", "regather", "reduce_scatter", "all_reduce"]
    group: Group
    ranks: int
    sent: float


def ring_bytes(nbytes: float, ranks: int, reduce: bool = False) -> float:
    """Bytes one rank sends in a ring collective of an ``nbytes`` buffer over ``ranks``."""
    if ranks < 2:
        return 0.0
    return (2.0 if reduce else 1.0) * nbytes * (ranks - 1) / ranks


def unit_collectives(
    shapes: Sequence[Sequence[int]], *, shard: int, replicas: int = 1, gather_itemsize: int, reduce_itemsize: int,
    reshard: bool | int | None,
) -> list[Collective]:
    """The collectives one unit of parameter ``shapes`` runs per step (``reshard``: an ``int`` is a smaller group)."""
    if not shapes:
        return []
    numel = shard_numel(shapes, shard) * shard  # dim 0 padded to the shard group
    gathered = numel * gather_itemsize
    out = [Collective("all_gather", "shard", shard, ring_bytes(gathered, shard))]
    if reshard is True:
        out.append(Collective("regather", "shard", shard, ring_bytes(gathered, shard)))
    elif reshard not in (False, None) and int(reshard) > 1:
        out.append(Collective("regather", "reshard", int(reshard), ring_bytes(gathered, int(reshard))))
    out.append(Collective("reduce_scatter", "shard", shard, ring_bytes(numel * reduce_itemsize, shard)))
    if replicas > 1:
        reduced = numel // shard * reduce_itemsize
        out.append(Collective("all_reduce", "replicate", replicas, ring_bytes(reduced, replicas, reduce=True)))
    return out
