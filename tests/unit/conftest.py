"""Unit-test fixtures: a world-size-1 gloo process group so FSDP2 runs in-process, in milliseconds."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture(scope="session")
def mesh():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
