"""The one model of an FSDP unit's collectives: which ones a step runs, over which group, and the bytes each rank
sends. The planner's step cost (:mod:`.step_cost`) times them; the setup summary's traffic report
(``sharding/traffic.py``) adds them up inside and across nodes.

Conventions, so numbers compare across layouts:

- each collective is a ring over its group of ``n`` ranks: an all-gather or reduce-scatter of a ``B``-byte
  buffer sends ``B (n - 1) / n`` bytes per rank, an all-reduce ``2 B (n - 1) / n``;
- a unit's buffer is its parameters with dim 0 padded to a multiple of the shard group (FSDP2's chunks,
  :func:`~lightning_vitscale._utils.shard_numel`);
- per unit and step: an all-gather in forward (compute dtype), a second one in backward where the unit freed its
  parameters after forward (over the shard group, or over the smaller group of an ``int`` reshard), a
  reduce-scatter of the gradients (reduce dtype) and, with replicas (hybrid sharding), an all-reduce of the
  reduced shard across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_vitscale._utils import shard_numel

Group = Literal["shard", "reshard", "replicate"]


@dataclass(frozen=True)
class Collective:
    """One collective of one unit in one step.

    Attributes:
        kind: ``"all_gather"`` (forward), ``"regather"`` (backward, after a reshard), ``"reduce_scatter"`` or
            ``"all_reduce"`` (across replicas).
        group: the ranks it runs over: the shard group, the smaller reshard group, or the replicas.
        ranks: that group's size.
        sent: bytes one rank sends.
    """

    kind: Literal["all_gather", "regather", "reduce_scatter", "all_reduce"]
    group: Group
    ranks: int
    sent: float


def ring_bytes(nbytes: float, ranks: int, reduce: bool = False) -> float:
    """Bytes one rank sends in a ring collective of an ``nbytes`` buffer over ``ranks`` (an all-reduce twice an
    all-gather's); nothing alone."""
    if ranks < 2:
        return 0.0
    return (2.0 if reduce else 1.0) * nbytes * (ranks - 1) / ranks


def gathered_numel(shapes: Sequence[Sequence[int]], shard: int) -> int:
    """Elements of a unit's all-gather buffer over a shard group of ``shard`` ranks (dim 0 padded)."""
    return shard_numel(shapes, shard) * shard


def unit_collectives(
    shapes: Sequence[Sequence[int]],
    *,
    shard: int,
    replicas: int = 1,
    gather_itemsize: int,
    reduce_itemsize: int,
    reshard: bool | int | None,
) -> list[Collective]:
    """The collectives one unit of parameter ``shapes`` runs per step (``reshard``: its reshard after forward,
    ``True``/``False``/``None`` or an ``int`` smaller group)."""
    if not shapes:
        return []
    numel = gathered_numel(shapes, shard)
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
