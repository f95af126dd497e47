"""Tensor parallelism inside the blocks: the ``parallelize_module`` calls of each block's plan (``tensor_plan.py``),
on the tensor-parallel sub-mesh, before FSDP shards the blocks over the data-parallel one (torch's documented
composition: TP first, then ``fully_shard`` over the other mesh dimension)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_vitscale.discovery.tensor_plan import BlockPlan, TensorPlanSelector, plan_block
from lightning_vitscale.row_layout import PACKED_ROWS, interleaved_rows

Named = list[tuple[str, nn.Module]]


class PackedColwiseParallel(ColwiseParallel):
    """Column-wise for a packed ``[q; k; v]`` projection: each rank holds its own heads' q, k and v rows.

    The rows are reordered ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]`` (``r``: rank) before the usual dim-0 split, so
    the rank's output reshapes to ``(3, heads per rank, head size)`` as the module's forward expects.
    """

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


STYLES: dict[str, Any] = {
    "colwise": ColwiseParallel, "rowwise": RowwiseParallel, "packed_colwise": PackedColwiseParallel,
}


@dataclass(frozen=True)
class TensorParallelFacts:
    """What ``apply_tp`` did: the tensor-parallel size, the plan per block class, and which projections hold
    their packed rows interleaved per rank (``module names``)."""

    size: int
    plans: dict[str, str]
    blocks: dict[str, int]
    interleaved: list[str]

    def describe(self) -> list[str]:
        return [f"{cls} x{self.blocks[cls]}: {plan}" for cls, plan in self.plans.items()]


def apply_tp(
    model: nn.Module, blocks: Named, *, mesh: DeviceMesh, plan: TensorPlanSelector | None, init_path: str
) -> TensorParallelFacts:
    """Split every block over ``mesh`` (the tensor-parallel dimension) by its plan; set per-rank head counts.

    Every rank must end with global rank 0's values (DDP's guarantee). ``init_path`` says how the weights were
    made (``InitialWeights.path``). ``"built"`` (the model built before setup, on every rank): rank 0's values are
    broadcast first and each block's shards cut from its tensor-parallel group's first rank. ``"exact"`` and
    ``"meta"`` (``configure_model()``): every rank splits meta tensors with no communication (rank 0's own values
    wait in ``InitialWeights.hold``); each unit's 2-D shards get their values as FSDP shards it.
    """
    built = init_path == "built"
    plans = [(name, block, plan_block(name, block, mesh.size(), plan)) for name, block in blocks]
    if built:
        _same_values_everywhere(model)
    interleaved: list[str] = []
    for name, block, block_plan in plans:
        parallelize_module(block, mesh, _styles(block_plan), src_data_rank=0 if built else None)
        for attr_path, value in block_plan.attributes.items():
            owner, _, attr = attr_path.rpartition(".")
            setattr(block.get_submodule(owner), attr, value)
        interleaved += [f"{name}.{n}" for n, role in block_plan.styles.items() if role == "packed_colwise"]
    described = {type(block).__name__: block_plan.describe() for _, block, block_plan in plans}
    counts = Counter(type(block).__name__ for _, block in blocks)
    return TensorParallelFacts(mesh.size(), described, dict(counts), interleaved)


def _styles(plan: BlockPlan) -> dict[str, Any]:
    return {name: STYLES[role]() if isinstance(role, str) else role for name, role in plan.styles.items()}


@torch.no_grad()
def _same_values_everywhere(model: nn.Module) -> None:
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)
