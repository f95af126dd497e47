"""Process groups and meshes: the device mesh of a sharding layout, collectives over it, the handshake before
gathers outside a step (on the process group's store, each rank saying where it is when a rank waits alone),
SIGTERM without a collective in its handler, and process-group teardown at exit.

The bottom layer: imports only ``_compat``, ``_utils``, torch and Lightning, never another concern.
"""

from lightning_vitscale.distributed.mesh import data_parallel_ranks
from lightning_vitscale.distributed.processes import check_accelerator, start_process_group
from lightning_vitscale.distributed.ranks import RankContext, mean_over_ranks, rank_context, reducing_whole
from lightning_vitscale.distributed.sigterm import take_over_sigterm
from lightning_vitscale.distributed.teardown import stop_local_ranks
from lightning_vitscale.distributed.whereabouts import counting_whereabouts, note_backward, note_batch

__all__ = [
    "RankContext",
    "check_accelerator",
    "counting_whereabouts",
    "data_parallel_ranks",
    "mean_over_ranks",
    "note_backward",
    "note_batch",
    "rank_context",
    "reducing_whole",
    "start_process_group",
    "stop_local_ranks",
    "take_over_sigterm",
]
