"""Where a model is sharded, as the setup and the planner see it: the one rank context (``distributed/ranks.py``)."""

from __future__ import annotations

from lightning_vitscale.distributed.ranks import RankContext

Ranks = RankContext  # the name sharding has always exported; the same type checkpoints and the planner take

__all__ = ["Ranks"]
