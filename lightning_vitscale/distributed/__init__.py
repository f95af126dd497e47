"""Process groups and meshes: the device mesh of a sharding layout, collectives over it, the side-group handshake
before gathers outside a step, SIGTERM without a collective in its handler, and process-group teardown at exit.

The bottom layer: imports only ``_compat``, ``_utils``, torch and Lightning, never another concern.
"""

from lightning_vitscale.distributed.collective_guard import open_side_group
from lightning_vitscale.distributed.mesh import build_mesh, data_parallel_ranks, shard_size, split_tensor_parallel
from lightning_vitscale.distributed.processes import check_accelerator, start_process_group
from lightning_vitscale.distributed.ranks import (
    RankContext,
    all_gather_objects,
    largest_over_ranks,
    mean_over_ranks,
    rank_context,
)
from lightning_vitscale.distributed.sigterm import take_over_sigterm
from lightning_vitscale.distributed.teardown import destroy_process_group_at_exit, stop_local_ranks, watch_local_ranks

__all__ = [
    "build_mesh",
    "data_parallel_ranks",
    "split_tensor_parallel",
    "destroy_process_group_at_exit",
    "RankContext",
    "all_gather_objects",
    "largest_over_ranks",
    "mean_over_ranks",
    "open_side_group",
    "rank_context",
    "shard_size",
    "check_accelerator",
    "start_process_group",
    "stop_local_ranks",
    "take_over_sigterm",
    "watch_local_ranks",
]
