"""Starting this rank's processes: Lightning's process group, its teardown at exit, the watch over the other local
ranks, its forked children's end with it, and the side group for gathers outside a step and for scalar reads of
sharded tensors, in that order (each needs the one before)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

from lightning_vitscale._compat import ModelParallelStrategy, set_device_mesh, setup_distributed
from lightning_vitscale.distributed.array_reads import read_whole_arrays
from lightning_vitscale.distributed.collective_guard import open_side_group
from lightning_vitscale.distributed.empty_shards import take_extremes_over_empty_shards
from lightning_vitscale.distributed.forked_children import end_forked_children_with_this_process
from lightning_vitscale.distributed.mesh import build_mesh
from lightning_vitscale.distributed.scalar_reads import read_whole_scalars
from lightning_vitscale.distributed.teardown import destroy_process_group_at_exit, watch_local_ranks


def check_accelerator(accelerator: object) -> None:
    """The strategy runs on gloo (CPU) or NCCL (CUDA): anything else fails here, naming the fix."""
    if accelerator is not None and not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator)):
        raise ValueError(
            f"VitScaleStrategy runs on accelerator='cpu' (gloo) or 'cuda' (NCCL), not"
            f" {type(accelerator).__name__}. Pass Trainer(accelerator='cuda') or accelerator='cpu'."
        )


def start_process_group(
    strategy: ModelParallelStrategy, module: Any, timeout: timedelta, shard_group: Callable[[int, int], int],
    tensor_parallel: int = 1,
) -> None:
    """The device, ranks and process group of ``strategy``, and its mesh (also ``module``'s): ``shard_group(world_size,
    ranks_per_node)`` ranks share one copy of the state, ``tensor_parallel`` consecutive ranks split each block."""
    setup_distributed(strategy)
    destroy_process_group_at_exit()
    watch_local_ranks(strategy.launcher)  # a child rank's death leaves this rank's own `except`/`finally` to run
    end_forked_children_with_this_process()  # a killed rank's loader workers must not keep its peers waiting
    # Gathers outside a step (model calls, state_dict()) first agree on it, so one rank alone never gathers.
    open_side_group(timeout)
    read_whole_scalars()  # `.item()` of a sharded tensor: DDP's number (agreed on the side group), not this rank's part
    read_whole_arrays(strategy.root_device)  # `.numpy()` of a DTensor (TensorBoard's histograms): values, else the fix
    take_extremes_over_empty_shards()  # `p.max()` of a `[1, 1, D]` class token: an empty shard must not raise alone
    shard = shard_group(strategy.world_size, strategy.num_processes)
    mesh = build_mesh(strategy.root_device.type, strategy.world_size, shard, tensor_parallel)
    set_device_mesh(strategy, module, mesh)
