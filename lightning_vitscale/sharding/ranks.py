"""Where a model is sharded, as the setup and the planner see it: one small value shared by both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Ranks:
    """Where the model is sharded: the mesh, this rank's device and place, and how ranks agree on a number.

    ``agree_max`` returns the largest of every rank's value (a collective): free host memory differs by rank,
    and every rank must still make the same choice.
    """

    mesh: DeviceMesh
    device: torch.device
    rank: int
    ranks_per_node: int
    agree_max: Callable[[int], int]
