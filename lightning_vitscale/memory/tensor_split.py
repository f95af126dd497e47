"""Tensor parallelism as the planner sees it: one tensor-parallel rank's share of each block, measured, and the
all-reduces of activations its step runs. Not derived: a meta twin is split by the same Megatron-style plan
(``discovery/tensor_plan.py``; :func:`split_twin`: a column-wise Linear keeps ``out / k`` rows, a row-wise one
``in / k`` columns and its whole bias, attention modules their per-rank head counts) and measured as any model.

The all-reduces (:class:`AllReduceLog`, counted in the activations' passes): a row-wise module's output after each
forward call (a checkpointed block's recompute runs them again as far as it goes), a column-wise module's input
gradient once per backward (HF's separate q, k, v Linears send three); rings over the ``k`` ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.hooks import RemovableHandle

from lightning_vitscale.discovery.tensor_plan import TensorPlanError, TensorPlanSelector, plan_block
from lightning_vitscale.memory.collectives import ring_bytes
from lightning_vitscale.memory.op_costs import tensors_of
from lightning_vitscale.memory.twin import meta_twin


@dataclass(frozen=True)
class BlockAllReduces:
    """One block's all-reduced bytes per step at the measured batch: the row-wise outputs (``forward``), the
    column-wise input gradients (``backward``), the row-wise outputs again in a recompute per checkpointing mode;
    ``calls``: all-reduces of a block not checkpointed."""

    forward: int
    backward: int
    recompute: dict[str, int] = field(default_factory=dict)
    calls: int = 0


@dataclass(frozen=True)
class TensorSplit:
    """Each block's all-reduces under tensor parallelism of ``ranks`` (the memory side is in the measured twin), and
    each block class's plan described."""

    ranks: int
    blocks: list[BlockAllReduces]
    plans: dict[str, str] = field(default_factory=dict)

    def sent(self, modes: list[str | None], scale: float = 1.0) -> float:
        """Bytes one rank sends per step, block ``i`` checkpointed in ``modes[i]``, at ``scale`` times the batch."""
        total = sum(b.forward + b.backward + (b.recompute.get(mode, 0) if mode else 0)
                    for b, mode in zip(self.blocks, modes, strict=True)) * scale
        return ring_bytes(total, self.ranks, reduce=True)


Roles = dict[str, str]
"""Module name inside a block -> ``"colwise"`` or ``"rowwise"`` (a packed ``[q; k; v]`` is column-wise)."""


def split_twin(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], ranks: int, plan: TensorPlanSelector | None
) -> tuple[nn.Module, list[tuple[str, nn.Module]], AllReduceLog]:
    """A meta twin of ``model`` whose blocks hold one rank's share by each block's plan, and the all-reduces' log."""
    twin = meta_twin(model)
    found = [(name, twin.get_submodule(name)) for name, _ in blocks]
    roles: list[Roles] = []
    described: dict[str, str] = {}
    for name, block in found:
        block_plan = plan_block(name, block, ranks, plan)
        described[type(block).__name__] = block_plan.describe()
        block_roles = {module: _role(style, name, module) for module, style in block_plan.styles.items()}
        for module, role in block_roles.items():
            _shrink(block.get_submodule(module), role, ranks, f"{name}.{module}")
        for attr_path, value in block_plan.attributes.items():
            owner, _, attr = attr_path.rpartition(".")
            setattr(block.get_submodule(owner), attr, value)
        roles.append(block_roles)
    return twin, found, AllReduceLog(ranks, roles, described)


def _role(style: Any, block: str, module: str) -> str:
    if isinstance(style, (str, ColwiseParallel, RowwiseParallel)):
        return "rowwise" if style == "rowwise" or isinstance(style, RowwiseParallel) else "colwise"
    raise TensorPlanError(
        f"the memory planner knows ColwiseParallel and RowwiseParallel styles; {block}.{module} has"
        f" {type(style).__name__}. Plan without it (tensor_parallel=1), or give those styles in tensor_plan=."
    )


def _shrink(module: nn.Module, role: str, ranks: int, where: str) -> None:
    """One rank's share of a Linear: ``out / ranks`` rows (column-wise) or ``in / ranks`` columns (row-wise)."""
    if not isinstance(module, nn.Linear):
        raise TensorPlanError(f"the memory planner splits Linear modules only; {where} is {type(module).__name__}.")
    dim = 0 if role == "colwise" else 1
    size = module.weight.shape[dim]
    if size % ranks:
        raise TensorPlanError(f"{where} has {size} {'output' if dim == 0 else 'input'} features, not divisible by"
                              f" tensor_parallel={ranks}.")
    shape = list(module.weight.shape)
    shape[dim] //= ranks
    module.weight = nn.Parameter(torch.empty(shape, dtype=module.weight.dtype, device="meta"),
                                 module.weight.requires_grad)
    if role == "colwise":
        module.out_features = shape[0]
        if module.bias is not None:
            module.bias = nn.Parameter(torch.empty(shape[0], dtype=module.bias.dtype, device="meta"),
                                       module.bias.requires_grad)
    else:
        module.in_features = shape[1]


class AllReduceLog:
    """Hooks where ``parallelize_module`` puts the all-reduces, on the blocks of the activations' passes."""

    def __init__(self, ranks: int, roles: list[Roles], plans: dict[str, str]) -> None:
        self.ranks, self.roles, self.plans = ranks, roles, plans
        self.rows: list[tuple[int, int]] = []
        self.cols: list[tuple[int, int]] = []

    def watching(self, index: int, block: nn.Module, resent: list[int] | None = None) -> list[RemovableHandle]:
        """Hooks logging block ``index``'s all-reduces; with ``resent``, a recompute's there (row-wise outputs)."""
        row: Callable[[int], None] = resent.append if resent is not None else lambda n: self.rows.append((index, n))
        handles = []
        for name, role in self.roles[index].items():
            module = block.get_submodule(name)
            if role == "rowwise":
                handles.append(module.register_forward_hook(lambda _, __, out: row(_float_bytes(out))))
            elif resent is None:
                handles.append(module.register_forward_pre_hook(
                    lambda _, args: self.cols.append((index, _float_bytes(args[:1])))))
        return handles

    def split(self, resent: list[dict[str, int]]) -> TensorSplit:
        """Each block's all-reduces per step, as the measured step ran them; ``resent``: each block's recompute's."""
        out = []
        for index, again in enumerate(resent):
            rows, cols = [n for i, n in self.rows if i == index], [n for i, n in self.cols if i == index]
            out.append(BlockAllReduces(sum(rows), sum(cols), again, len(rows) + len(cols)))
        return TensorSplit(self.ranks, out, self.plans)


def _float_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(tree) if t.is_floating_point())
