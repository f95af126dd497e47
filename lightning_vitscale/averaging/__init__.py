"""Weight averaging on shards: :class:`ShardedEMA` (each rank averages its own shards, no gather) and Lightning's
own ``WeightAveraging`` / ``StochasticWeightAveraging`` with their averaged copy sharded like the model.

May import ``checkpoint`` (the EMA rides in sharded checkpoints), ``_utils`` and ``_compat``.
"""

from lightning_vitscale.averaging.ema import ShardedEMA
from lightning_vitscale.averaging.lightning_callbacks import shard_averaged_copies

__all__ = ["ShardedEMA", "shard_averaged_copies"]
