"""Tensor parallelism as the planner sees it: one tensor-parallel rank's share of each block, measured, and the
all-reduces of activations its step runs.

``VitScaleStrategy(tensor_parallel=k)`` splits each block by its Megatron-style plan (``discovery/tensor_plan.py``)
before FSDP shards it over the data-parallel ranks. The planner does not derive what that changes: it splits a
meta-device twin of the model by the same plan (:func:`split_twin`: a column-wise Linear keeps ``out / k`` rows, a
row-wise one ``in / k`` columns and its whole bias, the attention modules their per-rank head counts; norms and
everything else stay whole) and measures the twin on fake tensors as it measures any model. So a block's
parameters, gradients and optimizer state are this rank's TP share before FSDP's dim-0 split over the data-parallel
ranks (``ModelLayout`` of the twin), the outer unit is whole before it, and the activations are this rank's: the
attention's and the MLP hidden layer's ``1/k``, the block's input, output and norms whole (``measure_activations``
on the twin).

The all-reduces (:func:`measure_collectives`, counted on the twin with hooks where ``parallelize_module`` puts
its collectives): a row-wise module all-reduces its output after each forward call (recompute included: a
checkpointed block's recompute runs them again as far as it goes, which fake tensors show for each mode), a
column-wise module its input's gradient once per backward (one per module: HF's separate q, k, v Linears send
three). Each is a ring over the ``k`` tensor-parallel ranks (:func:`~.collectives.ring_bytes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_vitscale._compat import ShapeEnv, tree_map
from lightning_vitscale.discovery.tensor_plan import TensorPlanError, TensorPlanSelector, plan_block
from lightning_vitscale.memory.activations import (
    StepCall,
    _fake_like,
    _FakeMode,
    _fp32_norm_hooks,
    _tensors,
    fake_parameters,
)
from lightning_vitscale.memory.block_identity import block_key
from lightning_vitscale.memory.collectives import ring_bytes
from lightning_vitscale.memory.selective_ops import selective_contexts
from lightning_vitscale.memory.twin import meta_twin

_CPU = torch.device("cpu")
CHECKPOINT_CONTEXTS = {"full": torch.utils.checkpoint.noop_context_fn, "selective": selective_contexts}


@dataclass(frozen=True)
class BlockAllReduces:
    """One block's tensor-parallel all-reduces per step, as bytes of the all-reduced buffers at the measured batch.

    Attributes:
        forward: the row-wise modules' outputs, once per forward.
        backward: the column-wise modules' input gradients, once per backward.
        recompute: per checkpointing mode (``"full"``, ``"selective"``), the row-wise outputs all-reduced again in
            the recompute (measured: the recompute stops after the last tensor backward needs).
        calls: how many all-reduces a plain (not checkpointed) block runs per step.
    """

    forward: int
    backward: int
    recompute: dict[str, int] = field(default_factory=dict)
    calls: int = 0

    def buffer_bytes(self, mode: str | None) -> int:
        """Bytes all-reduced per step for the block checkpointed in ``mode`` (``None``: not checkpointed)."""
        return self.forward + self.backward + (self.recompute.get(mode, 0) if mode else 0)


@dataclass(frozen=True)
class TensorSplit:
    """What tensor parallelism of ``ranks`` does to the planned step: each block's all-reduces (the memory side is
    in the measured twin itself), and each block class's plan, for the plan's summary."""

    ranks: int
    blocks: list[BlockAllReduces]
    plans: dict[str, str] = field(default_factory=dict)

    def sent(self, modes: list[str | None], scale: float = 1.0) -> float:
        """Bytes one rank sends per step over the tensor-parallel dimension, block ``i`` checkpointed in
        ``modes[i]``, the batch ``scale`` times the measured one (rings over the ``ranks``)."""
        total = sum(block.buffer_bytes(mode) for block, mode in zip(self.blocks, modes, strict=True)) * scale
        return ring_bytes(total, self.ranks, reduce=True)


Roles = dict[str, str]
"""Module name inside a block -> ``"colwise"`` or ``"rowwise"`` (a packed ``[q; k; v]`` is column-wise)."""


def split_twin(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], ranks: int, plan: TensorPlanSelector | None
) -> tuple[nn.Module, list[tuple[str, nn.Module]], list[Roles], dict[str, str]]:
    """A meta twin of ``model`` whose blocks hold one tensor-parallel rank's share, by each block's plan (the
    strategy's automatic one, or the user's ``tensor_plan``); the twin's blocks, each block's roles, and each block
    class's plan described. ``model`` is not changed."""
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

    @contextlib.contextmanager
    def watching(self, blocks: list[tuple[str, nn.Module]], roles: list[Roles]) -> Iterator[None]:
        handles = []
        for index, ((_, block), block_roles) in enumerate(zip(blocks, roles, strict=True)):
            for module_name, role in block_roles.items():
                module = block.get_submodule(module_name)
                if role == "rowwise":
                    handles.append(module.register_forward_hook(self._row(index)))
                else:
                    handles.append(module.register_forward_pre_hook(self._col(index)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _row(self, index: int):
        def hook(_: nn.Module, __: Any, out: Any) -> None:
            self.rows.append((index, _float_bytes(out)))

        return hook

    def _col(self, index: int):
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            self.cols.append((index, _float_bytes(args[:1])))

        return hook


def _float_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(tree) if t.is_floating_point())


def measure_collectives(
    twin: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    roles: list[Roles],
    example_input: Any,
    compute: torch.dtype,
    norms: list[nn.Module] | None = None,
    call: StepCall | None = None,
) -> list[BlockAllReduces]:
    """Each block's all-reduces per step: the twin's forward on fake tensors (``call`` as the activations are
    measured) gives the forward and backward ones, a checkpointed pass per mode of each distinct block its
    recompute's."""
    norms = norms or []
    norm_ids = {id(m) for m in norms}
    log = _AllReduceLog()
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(index: int):
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            first = next((t for t in _tensors(args) if t.is_floating_point()), None)
            if first is not None:
                inputs.setdefault(index, first)

        return hook

    mode = _FakeMode(shape_env=ShapeEnv()) if call is not None else _FakeMode()
    with fake_parameters(twin, mode, compute, lambda m: id(m) in norm_ids), _fp32_norm_hooks(norms, compute):
        with mode:
            fake_input = tree_map(lambda v: _fake_like(v, compute), example_input)
        handles = [b.register_forward_pre_hook(keep_input(i)) for i, (_, b) in enumerate(blocks)]
        try:
            with mode, torch.no_grad(), log.watching(blocks, roles):
                (call(twin, fake_input) if call is not None else
                 twin(*fake_input) if isinstance(fake_input, tuple) else twin(fake_input))
        finally:
            for handle in handles:
                handle.remove()
        recomputed: dict[Any, dict[str, int]] = {}
        result = []
        for index, (_, block) in enumerate(blocks):
            forward = sum(n for i, n in log.rows if i == index)
            backward = sum(n for i, n in log.cols if i == index)
            calls = sum(i == index for i, _ in log.rows) + sum(i == index for i, _ in log.cols)
            x = inputs.get(index)
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
        first = next(t for t in _tensors(out) if t.requires_grad)
        in_forward = len(log.rows)
        torch.autograd.backward(first, torch.empty_like(first))
    for p in block.parameters():
        p.grad = None
    return sum(n for _, n in log.rows[in_forward:])
