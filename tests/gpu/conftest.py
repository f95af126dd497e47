"""Each GPU test starts from an empty allocator: what an earlier test left (reference cycles through FSDP's hooks
wait for the garbage collector; a failed test's frames keep its model alive) must not count in this test's memory
measurements or caps. Seen on the first H200 run: 9.6 GiB left by the planner's cases made the offload test's
700 MiB cap fail at setup, and each planner case measured its predecessors too."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def empty_allocator() -> Iterator[None]:
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
