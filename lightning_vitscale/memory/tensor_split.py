"""Tensor parallelism as the planner sees it: one tensor-parallel rank's share of each block, measured, and the
all-reduces of activations its step runs.

The planner does not derive what ``tensor_parallel=k`` changes: it splits a meta twin of the model by the same
Megatron-style plan (``discovery/tensor_plan.py``; :func:`split_twin`: a column-wise Linear keeps ``out / k`` rows,
a row-wise one ``in / k`` columns and its whole bias, attention modules their per-rank head counts) and measures the
twin as any model: its layout is this rank's share before FSDP's split, its activations this rank's.

The all-reduces (:func:`measure_collectives`, hooks where ``parallelize_module`` puts them): a row-wise module's
output after each forward call (a checkpointed block's recompute runs them again as far as it goes), a column-wise
module's input gradient once per backward (HF's separate q, k, v Linears send three); rings over the ``k`` ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_vitscale.discovery.tensor_plan import TensorPlanError, TensorPlanSelector, plan_block
from lightning_vitscale.memory.activations import StepCall, _Recorder, fake_step, removing, run_step
from lightning_vitscale.memory.block_identity import block_key
from lightning_vitscale.memory.collectives import ring_bytes
from lightning_vitscale.memory.op_costs import tensors_of
from lightning_vitscale.memory.selective_ops import selective_contexts
from lightning_vitscale.memory.twin import meta_twin

_CPU = torch.device("cpu")
CHECKPOINT_CONTEXTS = {"full": torch.utils.checkpoint.noop_context_fn, "selective": selective_contexts}


@dataclass(frozen=True)
class BlockAllReduces:
    """One block's all-reduced bytes per step at the measured batch: the row-wise outputs (``forward``), the
    column-wise input gradients (``backward``), the row-wise outputs again in a recompute per checkpointing mode;
    ``calls``: all-reduces of a block not checkpointed."""

    forward: int
    backward: int
    recompute: dict[str, int] = field(default_factory=dict)
    calls: int = 0

    def buffer_bytes(self, mode: str | None) -> int:
        return self.forward + self.backward + (self.recompute.get(mode, 0) if mode else 0)


@dataclass(frozen=True)
class TensorSplit:
    """Each block's all-reduces under tensor parallelism of ``ranks`` (the memory side is in the measured twin), and
    each block class's plan described."""

    ranks: int
    blocks: list[BlockAllReduces]
    plans: dict[str, str] = field(default_factory=dict)

    def sent(self, modes: list[str | None], scale: float = 1.0) -> float:
        """Bytes one rank sends per step, block ``i`` checkpointed in ``modes[i]``, the batch ``scale`` times the
        measured one."""
        total = sum(block.buffer_bytes(mode) for block, mode in zip(self.blocks, modes, strict=True)) * scale
        return ring_bytes(total, self.ranks, reduce=True)


Roles = dict[str, str]
"""Module name inside a block -> ``"colwise"`` or ``"rowwise"`` (a packed ``[q; k; v]`` is column-wise)."""


def split_twin(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], ranks: int, plan: TensorPlanSelector | None
) -> tuple[nn.Module, list[tuple[str, nn.Module]], list[Roles], dict[str, str]]:
    """A meta twin of ``model`` whose blocks hold one tensor-parallel rank's share by each block's plan; its blocks,
    each block's roles, and each block class's plan described."""
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
    return twin, found, roles, described


def _role(style: Any, block: str, module: str) -> str:
    if isinstance(style, str):
        return "rowwise" if style == "rowwise" else "colwise"
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
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


class _AllReduceLog:
    """Hooks where ``parallelize_module`` puts the collectives: after a row-wise module's forward (its output),
    before a column-wise module's forward (its input, whose gradient is all-reduced once in backward)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []
        self.cols: list[tuple[int, int]] = []

    def watching(self, blocks: list[tuple[str, nn.Module]], roles: list[Roles]) -> contextlib.ExitStack:
        handles = []
        for index, ((_, block), block_roles) in enumerate(zip(blocks, roles, strict=True)):
            for module_name, role in block_roles.items():
                module = block.get_submodule(module_name)
                if role == "rowwise":
                    handles.append(module.register_forward_hook(self._row(index)))
                else:
                    handles.append(module.register_forward_pre_hook(self._col(index)))
        return removing(handles)

    def _row(self, index: int):
        def hook(_: nn.Module, __: Any, out: Any) -> None:
            self.rows.append((index, _float_bytes(out)))

        return hook

    def _col(self, index: int):
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            self.cols.append((index, _float_bytes(args[:1])))

        return hook


def _float_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(tree) if t.is_floating_point())


def measure_collectives(
    twin: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    roles: list[Roles],
    example_input: Any,
    compute: torch.dtype,
    norms: list[nn.Module] | None = None,
    call: StepCall | None = None,
) -> list[BlockAllReduces]:
    """Each block's all-reduces per step: the twin's forward on fake tensors (as the activations are measured) gives
    the forward and backward ones, a checkpointed pass per mode of each distinct block its recompute's."""
    log, recorder = _AllReduceLog(), _Recorder(set())  # the recorder: each block's input
    with fake_step(twin, example_input, compute, norms or [], call) as (mode, fake_input):
        handles = [b.register_forward_pre_hook(recorder.enter(i)) for i, (_, b) in enumerate(blocks)]
        with removing(handles), mode, torch.no_grad(), log.watching(blocks, roles):
            run_step(twin, fake_input, call)
        recomputed: dict[Any, dict[str, int]] = {}
        result = []
        for index, (_, block) in enumerate(blocks):
            forward = sum(n for i, n in log.rows if i == index)
            backward = sum(n for i, n in log.cols if i == index)
            calls = sum(i == index for i, _ in log.rows) + sum(i == index for i, _ in log.cols)
            x = recorder.inputs.get(index)
            again: dict[str, int] = {}
            if x is not None:
                key = block_key(block, x)
                if key not in recomputed:
                    recomputed[key] = {m: _recompute_bytes(block, roles[index], x, mode, m) for m in
                                       CHECKPOINT_CONTEXTS}
                again = recomputed[key]
            result.append(BlockAllReduces(forward, backward, again, calls))
    return result


def _recompute_bytes(block: nn.Module, roles: Roles, x: torch.Tensor, mode: Any, checkpointing: str) -> int:
    """Row-wise outputs all-reduced again while backward recomputes ``block`` checkpointed as ``checkpointing``."""
    log = _AllReduceLog()
    with mode, log.watching([("", block)], [roles]):
        inp = torch.empty(x.shape, dtype=x.dtype, device=_CPU, requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(block, inp, use_reentrant=False,
                                                context_fn=CHECKPOINT_CONTEXTS[checkpointing])
        first = next(t for t in tensors_of(out) if t.requires_grad)
        in_forward = len(log.rows)
        torch.autograd.backward(first, torch.empty_like(first))
    for p in block.parameters():
        p.grad = None
    return sum(n for _, n in log.rows[in_forward:])
