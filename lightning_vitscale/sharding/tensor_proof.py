"""Every tensor-parallel plan proven before the first step: a copy of each distinct block split by its plan on the
tensor-parallel group runs against an unsplit copy, on the input a training step gives it (the shapes the setup's
fake-tensor step recorded, batch cut to 2, random values). Output and input gradient must agree within fp32
rounding and (automatic plans) the attention's work must be split; anything else is refused at setup on every
rank, naming the block, the module and the fix: never a crash at the first step, never a silent difference.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_vitscale._compat import tree_leaves, tree_map
from lightning_vitscale._utils import derived_attributes, private_copy
from lightning_vitscale.discovery.blocks import Named
from lightning_vitscale.discovery.calls import Calls, TensorSpec, recording
from lightning_vitscale.discovery.tensor_plan import BlockPlan, TensorPlanError, TensorPlanSelector, plan_block
from lightning_vitscale.sharding.tensor_parallel import split_block

TOLERANCE = 1e-4
"""Largest relative (norm) difference of output or input gradient: fp32 rounding of a split block is ~1e-7, a
wrong split O(1)."""
PROOF_BATCH = 2  # samples the proof runs (the recorded batch dimension, cut)
_ATTENTION = {F.scaled_dot_product_attention, F.softmax, torch.softmax, torch.Tensor.softmax,
              F.multi_head_attention_forward}  # seen at the outermost call (a mode sees nothing inside its handler)


@dataclass(frozen=True)
class Run:
    """One forward and backward of a block; ``attention``: the elements of the attention calls' first inputs."""

    output: torch.Tensor
    gradients: list[torch.Tensor]
    attention: int
    outputs: dict[str, torch.Tensor]


def prove_plans(
    blocks: Named, *, plan: TensorPlanSelector | None, mesh: DeviceMesh, calls: Calls | None,
    device: torch.device, real_values: bool,
) -> dict[str, str]:
    """Block class -> what its proof found (for the summary); :class:`TensorPlanError` on every rank if any failed.
    ``real_values``: every rank holds the blocks' real values (else seeded stand-ins)."""
    found: dict[str, str] = {}
    proven: set[tuple[Any, ...]] = set()
    failure = ""
    for name, block in blocks:
        key = (type(block), *((n, tuple(p.shape)) for n, p in block.named_parameters()))
        if key in proven:
            continue
        try:
            found.setdefault(type(block).__name__, _prove(name, block, plan, mesh, calls, device, real_values))
        except Exception as error:  # noqa: BLE001 - refused below, on every rank together
            failure = str(error) if isinstance(error, TensorPlanError) else (
                f"proving the tensor-parallel plan of {type(block).__name__} ({name}) at setup failed:"
                f" {type(error).__name__}: {error}")
            break
        proven.add(key)
    flag = torch.tensor([1.0 if failure else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # no rank goes on while another refuses
    if flag.item():
        raise TensorPlanError(failure or "the tensor-parallel plan was refused on another rank (its error says why).")
    return found


def _prove(
    name: str, block: nn.Module, user: TensorPlanSelector | None, mesh: DeviceMesh, calls: Calls | None,
    device: torch.device, real_values: bool,
) -> str:
    ranks = mesh.size()
    recorded = calls.inputs.get(name) if calls is not None else None
    if recorded is None:
        raise TensorPlanError(_unproven(name, block, ranks, calls))
    with _exact_fp32():
        whole, inputs = _reference_run(_copy(block, device, real_values), recorded, device)  # one copy at a time
        split = _copy(block, device, real_values)
        block_plan = plan_block(name, split, ranks, user)  # a user's callable sets the split copy's head counts
        split_block(split, mesh, block_plan, values_everywhere=False)  # as apply_tp splits the real blocks
        shape = tuple(next(t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)).shape)
        seen = Calls()
        try:
            got = _run(split, inputs, seen)
        except Exception as error:  # noqa: BLE001 - the refusal says what it was and where
            raise TensorPlanError(_refusal(name, block, block_plan, ranks, shape, f"raises {seen.error}",
                                           seen.where)) from error
    output = _apart(got.output, whole.output)
    gradient = max((_apart(a, b) for a, b in zip(got.gradients, whole.gradients, strict=True)), default=0.0)
    if output > TOLERANCE or gradient > TOLERANCE:
        what = f"gives outputs {output:.1e} apart and input gradients {gradient:.1e} apart (relative)"
        raise TensorPlanError(_refusal(name, block, block_plan, ranks, shape, what, _first_apart(got, whole)))
    whole_attention = whole.attention > 0 and got.attention * ranks > whole.attention
    if whole_attention and user is None:
        what = "leaves attention whole (each rank computes every head's scores)"
        raise TensorPlanError(_refusal(name, block, block_plan, ranks, shape, what, ""))
    attention = ("no attention" if not whole.attention else "attention whole (tensor_plan)" if whole_attention else
                 f"heads split over {ranks}")
    return f"{attention}; proven on input {shape}: output {output:.0e}, input gradient {gradient:.0e} apart"


def _reference_run(block: nn.Module, recorded: tuple[Any, ...], device: torch.device) -> tuple[Run, Any]:
    """The unsplit block on the recorded input, batch cut (else whole: a length tied to a buffer's shape)."""
    failure = ""
    for batch in (PROOF_BATCH, None):
        inputs = _stand_in(recorded, device, batch)
        try:
            whole = _run(block, inputs, Calls())
        except Exception as error:  # noqa: BLE001 - said below if the whole input fails too
            failure = f"fails ({type(error).__name__}: {error})"
            continue
        if all(torch.isfinite(t).all() for t in [whole.output, *whole.gradients]):
            return whole, inputs
        failure = "gives non-finite values"
    raise TensorPlanError(f"the tensor-parallel plan of {type(block).__name__} could not be proven: the unsplit"
                          f" block {failure} on random inputs of the recorded shapes. Use tensor_parallel=1.")


def _run(module: nn.Module, inputs: Any, calls: Calls) -> Run:
    """Forward in eval mode (dropout draws nothing), then backward of a fixed random projection of the output."""
    module.eval()
    args, kwargs = tree_map(
        lambda v: v.detach().clone().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v, inputs
    )
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    with recording(module, calls, keep_outputs=True), _AttentionWork() as attention:
        out = module(*args, **kwargs)
    first = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    first = first.full_tensor() if isinstance(first, DTensor) else first
    weight = torch.randn(first.shape, generator=torch.Generator().manual_seed(0)).to(first.device)
    # The input gradients alone: no parameter gradient is accumulated (setup memory holds one block copy, no more).
    found = torch.autograd.grad((first * weight).sum(), leaves, allow_unused=True) if leaves else ()
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(found, leaves, strict=True)]
    return Run(first.detach(), grads, attention.elements, calls.outputs)


class _AttentionWork(TorchFunctionMode):
    """Counts the elements attention calls take (their first input: queries, or the scores of a softmax): a rank
    that computes only its heads counts ``1 / k`` of them."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _ATTENTION and args and isinstance(args[0], torch.Tensor):
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


def _copy(block: nn.Module, device: torch.device, real_values: bool) -> nn.Module:
    """An fp32 copy of ``block`` on ``device``: its own values, or seeded stand-ins, the same on every rank and call
    (floating buffers in [0.5, 1.5): a variance stays one; integer ones zero: valid indices)."""
    twin = private_copy(block, {id(t): t.detach() for t in derived_attributes(block)})  # old weight_norm's
    if real_values:
        return twin.to(device=device, dtype=torch.float32)
    twin = twin.to_empty(device=device).float()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in twin.parameters():
            scale = 1 / math.sqrt(param.shape[-1]) if param.dim() else 1.0
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
        for buffer in twin.buffers():
            buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5) if buffer.is_floating_point() else (
                buffer.zero_())
    return twin


def _stand_in(recorded: tuple[Any, ...], device: torch.device, batch: int | None) -> Any:
    """Tensors of the recorded shapes (random floats, zero integers), the leading batch dimension cut to ``batch``."""
    specs = [s for s in tree_leaves(recorded) if isinstance(s, TensorSpec) and s.dtype.is_floating_point]
    full = specs[0].shape[0] if specs and specs[0].shape else None
    generator = torch.Generator().manual_seed(1)

    def make(value: Any) -> Any:
        if not isinstance(value, TensorSpec):
            return value
        shape = value.shape
        if batch is not None and shape and shape[0] == full:
            shape = (min(batch, shape[0]), *shape[1:])
        if value.dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(device)
        return torch.zeros(shape, dtype=value.dtype, device=device)

    return tree_map(make, recorded)


def _apart(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape or not torch.isfinite(got).all():
        return math.inf
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


def _first_apart(got: Run, whole: Run) -> str:
    """The first module (in order of return) whose output differs at the same shape."""
    for name, out in got.outputs.items():
        expected = whole.outputs.get(name)
        if expected is not None and not isinstance(out, DTensor) and out.shape == expected.shape and (
                _apart(out, expected) > TOLERANCE):
            return name or "the block itself"
    return ""


@contextlib.contextmanager
def _exact_fp32() -> Iterator[None]:
    """No TF32 while proving: the tolerance is fp32's."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def _refusal(name: str, block: nn.Module, plan: BlockPlan, ranks: int, shape: tuple[int, ...], what: str,
             where: str) -> str:
    held = plan.held_whole(block)
    return (
        f"tensor_parallel={ranks}: the {plan.family} tensor-parallel plan of {type(block).__name__} ({name}:"
        f" {plan.describe()}) {what}{f' in {where}' if where else ''}, run split on the tensor-parallel group at"
        f" setup against the same block unsplit (input {shape}).{held} Pass tensor_plan= with a style for each"
        " module that can be split (e.g. {'mlp.fc1': ColwiseParallel(), 'mlp.fc2': RowwiseParallel()}: the MLP"
        " only; modules left out stay whole), or use tensor_parallel=1."
    )


def _unproven(name: str, block: nn.Module, ranks: int, calls: Calls | None) -> str:
    why = (f"the training step run on fake tensors at setup stopped first{f' in {calls.where}' if calls.where else ''}"
           f" ({calls.error})" if calls is not None and calls.error else
           "no training step was measured at setup: set `example_input_array` (or fit on a map-style dataset)")
    return (f"tensor_parallel={ranks}: the tensor-parallel plan of {type(block).__name__} ({name}) is proven at setup"
            f" on the input a training step gives it, and could not be: {why}. Or use tensor_parallel=1.")
