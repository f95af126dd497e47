"""Tensor parallelism inside the blocks: the ``parallelize_module`` call of a block's plan (``tensor_plan.py``) on the
tensor-parallel sub-mesh, before FSDP shards the blocks over the data-parallel one (torch's documented composition:
TP first, then ``fully_shard`` over the other mesh dimension); ``steps.apply_tp`` splits every block with it once
``tensor_proof.py`` proved each plan."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_vitscale.discovery.tensor_plan import BlockPlan
from lightning_vitscale.row_layout import PACKED_ROWS, interleaved_rows


class PackedColwiseParallel(ColwiseParallel):
    """Column-wise for a packed ``[q; k; v]`` projection: rows reordered ``[q_0; k_0; v_0; q_1; ...]`` (by rank)
    before the usual dim-0 split, so a rank's output reshapes to ``(3, heads per rank, head size)`` as before."""

    def __init__(self, parts: int = 3) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear)
        interleave_rows(module, self.parts, device_mesh.size())
        # Every full view of these rows (state dicts, full checkpoints) is turned back into the model's own order.
        module.__dict__[PACKED_ROWS] = (self.parts, device_mesh.size())
        return super()._apply(module, device_mesh)


@torch.no_grad()
def interleave_rows(linear: nn.Linear, parts: int, ranks: int) -> None:
    """``[p_0 | p_1 | ...]`` (``parts`` blocks of rows) -> each rank's slice of every part, rank after rank."""
    for param in (linear.weight, linear.bias):
        if param is not None:
            param.copy_(interleaved_rows(param, parts, ranks))


SPLIT_ATTRIBUTES = "_vitscale_split_attributes"  # on a split module: {attribute: its value before the split}

STYLES: dict[str, Any] = {
    "colwise": ColwiseParallel, "rowwise": RowwiseParallel, "packed_colwise": PackedColwiseParallel,
}


def split_block(block: nn.Module, mesh: DeviceMesh, plan: BlockPlan, values_everywhere: bool) -> None:
    """Split ``block`` over ``mesh`` by ``plan`` and set its per-rank attributes (head counts). ``values_everywhere``:
    every rank holds global rank 0's values, and each piece is cut from its tensor-parallel group's first rank's
    (else each rank cuts its own tensors, meta ones included, with no communication)."""
    styles = {name: STYLES[role]() if isinstance(role, str) else role for name, role in plan.styles.items()}
    parallelize_module(block, mesh, styles, src_data_rank=0 if values_everywhere else None)
    for attr_path, value in plan.attributes.items():
        owner, _, attr = attr_path.rpartition(".")
        module = block.get_submodule(owner)
        module.__dict__.setdefault(SPLIT_ATTRIBUTES, {}).setdefault(attr, getattr(module, attr))  # a plain copy's
        setattr(module, attr, value)


@torch.no_grad()
def same_values_everywhere(model: nn.Module) -> None:
    """Every rank takes global rank 0's values (DDP's broadcast)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)
