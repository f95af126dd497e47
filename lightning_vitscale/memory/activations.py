"""A model's activation memory per block on fake tensors (no real memory, any model size): one forward and
backward, parameters fake in the compute dtype; ``saved_tensors_hooks`` count what each block keeps (by storage,
for the first block that saved it), a dispatch mode each block's backward transient. Fake CPU tensors pick CUDA's
SDPA kernel family (no N x N matrix): one measurement serves CPU and GPU plans.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_vitscale._compat import (
    FakeTensorMode,
    TorchDispatchMode,
    buffer_slots,
    fake_kernel_failures_unlogged,
    parameter_slots,
    storage_id,
    tree_map,
)
from lightning_vitscale.discovery.blocks import outer_layers_of
from lightning_vitscale.discovery.gradient_reach import parameters_without_gradient
from lightning_vitscale.memory.block_passes import (
    Arguments,
    BlockCalls,
    BlockMemory,
    block_memory,
    modes_to_measure,
    removing,
    spec,
)
from lightning_vitscale.memory.fake_modes import (
    RealValues,
    carrying_real_values,
    concrete,
    fake_batch_tensor,
    fake_mode,
    on_host,
)
from lightning_vitscale.memory.op_costs import tensors_of
from lightning_vitscale.memory.selective_ops import blocks_calling_blocks
from lightning_vitscale.precision.casting import floating_buffers, to_dtype

if TYPE_CHECKING:
    from lightning_vitscale.memory.tensor_split import AllReduceLog

_CPU = torch.device("cpu")

StepCall = Callable[[nn.Module, Any], Any]
"""How the measured forward is run: ``call(model, fake_input)`` (default ``model(fake_input)``, a tuple unpacked)."""
ModeOf = Callable[[int, str, nn.Module], "str | None"]
"""The checkpointing a block will run: ``mode_of(index, name, block)`` -> ``"full"``, ``"selective"`` or ``None``."""


@dataclass(frozen=True)
class ActivationProfile:
    """Per-block and outer-layer activation bytes of one forward + backward.

    ``outer_saved``: what the layers outside the blocks keep (not the resident batch, ``batch_bytes``, unless the
    step casts it), ``outer_saved_after`` of it after the last block (head, final norm: freed before any block's
    backward); ``outer_backward``: held through the blocks' backward: the output's gradient and the unsharded
    gradients of outer parameters used after the blocks (the patch embedding's come after every block's).
    """

    blocks: list[BlockMemory]
    outer_saved: int
    outer_backward: int
    batch_bytes: int
    outer_saved_after: int = 0
    order: tuple[int, ...] = ()  # the blocks (indices) in the order the step called them, a call each
    without_gradient: tuple[str, ...] | None = None  # trainable ones the step's loss does not reach (None: unknown)


@contextlib.contextmanager
def fake_parameters(
    model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype, keep_fp32: Callable[[nn.Module], bool],
    values: RealValues | None = None,
) -> Iterator[None]:
    """Every parameter and buffer of ``model`` a fake CPU tensor inside, in the dtype the step meets it in (FSDP casts
    parameters; saved buffers keep theirs, unsaved ones take ``dtype``: :func:`floating_buffers`); restored after.
    With ``values`` (and ``mode`` propagating real tensors) each carries its real value in that dtype."""
    slots: list[tuple[dict, str, Any, torch.dtype, bool]] = []
    for module in model.modules():
        norm = keep_fp32(module)
        wanted, params = torch.float32 if norm else dtype, parameter_slots(module)
        saved = set() if norm else set(floating_buffers(module)[1])  # a norm's: as its parameters
        for store in (params, buffer_slots(module)):
            for name, value in list(store.items()):
                if value is not None:
                    keeps = not value.is_floating_point() or (store is not params and name in saved)
                    slots.append((store, name, value, value.dtype if keeps else wanted, store is params))
    real = [None if values is None else on_host(values.get(id(value)), value, kind)
            for _, _, value, kind, _ in slots]  # before entering the mode: real copies, not fake ones
    originals: list[tuple[dict, str, Any]] = []
    try:
        with mode:  # entered once: entering per tensor cost more than making the tensor
            for (store, name, value, kind, is_param), real_value in zip(slots, real):
                originals.append((store, name, value))
                fake = (torch.empty(value.shape, dtype=kind, device=_CPU) if real_value is None  # a DTensor's: full
                        else mode.from_tensor(real_value))
                store[name] = nn.Parameter(fake, value.requires_grad) if is_param else fake  # type: ignore[assignment]
        yield
    finally:
        for store, name, value in reversed(originals):
            store[name] = value


@contextlib.contextmanager
def _fp32_norm_hooks(norms: list[nn.Module], compute: torch.dtype) -> Iterator[None]:
    """As precision/norms.py runs them: fp32 inputs into each norm, its output back in the compute dtype."""

    def enter(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tree_map(lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v, args)

    def leave(_: nn.Module, __: Any, out: Any) -> Any:
        return tree_map(lambda v: v.to(compute) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, out)

    with removing([h for m in norms for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]):
        yield


@contextlib.contextmanager
def _inputs_cast(layers: list[tuple[str, nn.Module]], compute: torch.dtype) -> Iterator[None]:
    """As the strategy runs them under a low-precision flag: each block (its unit) and each layer of the outer unit
    casts its floating inputs to ``compute`` (``precision.cast_floating_inputs``)."""
    if compute == torch.float32:
        yield
        return
    cast = functools.partial(tree_map, to_dtype(compute))

    def enter(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return cast(args), cast(kwargs)

    with removing([module.register_forward_pre_hook(enter, with_kwargs=True) for _, module in layers]):
        yield


@dataclass
class _Recorder:
    """Who saved each storage first (and how many block forwards had ended then), and each block's input (its first
    floating tensor argument) and whole arguments (``block(x, thw)``, ``layer(hidden, mask=...)``: a block is
    measured alone on what the step gave it). A block the step calls several times (a block every layer shares; a
    backbone run on each crop size, as DINO's) is measured on its largest call, and ``sizes`` has every call's
    input bytes."""

    excluded: set[int]
    current: int | None = None
    owner: dict[int, tuple[int | None, int, int, int]] = field(default_factory=dict)  # block, bytes, done, call
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    arguments: dict[int, Arguments] = field(default_factory=dict)
    sizes: dict[int, list[int]] = field(default_factory=dict)  # each forward's input bytes, per block
    sequence: list[int] = field(default_factory=list)  # the blocks in the order the step called them, a call each
    blocks_done: int = 0  # block forwards ended so far
    call: int = 0  # which call of the current block this is (0: its first)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_id(tensor)
        if key not in self.excluded and key not in self.owner:
            self.owner[key] = (self.current, tensor.untyped_storage().nbytes(), self.blocks_done, self.call)
        return tensor

    def enter(self, index: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.current = index
            self.sequence.append(index)
            sizes = self.sizes.setdefault(index, [])
            self.call = len(sizes)
            first = next((t for t in tensors_of((args, kwargs)) if t.is_floating_point()), None)
            if first is None:
                return
            size = first.untyped_storage().nbytes()
            if not sizes or size > max(sizes):
                self.inputs[index] = first
                self.arguments[index] = tree_map(functools.partial(spec, first=first), (args, kwargs))
            sizes.append(size)

        return hook

    def leave(self, _: nn.Module, __: Any, ___: Any) -> None:
        self.current = None
        self.blocks_done += 1

    def saved_by(self, index: int | None, call: int | None = None) -> int:
        """What block ``index`` saved for backward: in all its calls, or in its ``call``-th."""
        return sum(nbytes for owner, nbytes, _, c in self.owner.values() if owner == index and call in (None, c))

    def calls_of(self, index: int) -> BlockCalls:
        return BlockCalls(self.inputs.get(index), self.arguments.get(index), self.sizes.get(index, []),
                          self.saved_by(index), self.saved_by(index, call=0))

    def saved_after_blocks(self) -> int:  # by the outer layers, after the last block's forward (if any ran)
        done = self.blocks_done
        return sum(nbytes for owner, nbytes, when, _ in self.owner.values()
                   if owner is None and done and when == done)


class _OuterParameterUse(TorchDispatchMode):
    """The outer parameters used after the last block: their gradients come first in backward and stay (unsharded,
    in the root unit) through every block's backward."""

    def __init__(self, parameters: dict[int, int], recorder: _Recorder) -> None:
        super().__init__()
        self.parameters, self.recorder = parameters, recorder  # storage key -> bytes
        self.done_when_used: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for tensor in tensors_of((args, kwargs)):
            key = storage_id(tensor)
            if key in self.parameters:
                self.done_when_used[key] = self.recorder.blocks_done
        return func(*args, **(kwargs or {}))

    def used_after_blocks(self) -> int:
        done = self.recorder.blocks_done
        return sum(nbytes for key, nbytes in self.parameters.items() if done and self.done_when_used.get(key) == done)


_PASSES: dict[Hashable, dict[Any, Any]] = {}  # each block pass of this process, by context, then block_key: a later
# setup of the same architecture (a second fit, a sweep) runs only the whole forward again. Numbers, never a module.


def measure_activations(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], example_input: Any, compute: torch.dtype = torch.float32,
    norms: list[nn.Module] | None = None, call: StepCall | None = None, mode_of: ModeOf | None = None,
    all_reduces: AllReduceLog | None = None, values: RealValues | None = None, batch_dtype: torch.dtype | None = None,
) -> ActivationProfile:
    """What each block keeps and needs, from one forward (``call``, default ``model(example_input)``) and backward on
    fake tensors, ``norms`` in fp32, and, as the strategy runs them, each block and each layer outside the blocks
    casting its floating inputs to ``compute``. ``batch_dtype``: the floating batch tensors' dtype (``None``: as
    given, as the mixed flags hand the batch to the step). ``mode_of``: each block's settled checkpointing, measured
    alone (a third of the work; ``None``: every mode). ``values``: the fake tensors carry real ones (the step computes
    for real on the host, beside the fake run), for a step whose branches or shapes follow its values."""
    with carrying_real_values(values is not None), fake_kernel_failures_unlogged():
        return _measure(model, blocks, example_input, compute, norms, call, mode_of, all_reduces, values, batch_dtype)


def _measure(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], example_input: Any, compute: torch.dtype,
    norms: list[nn.Module] | None, call: StepCall | None, mode_of: ModeOf | None, all_reduces: AllReduceLog | None,
    values: RealValues | None, batch_dtype: torch.dtype | None,
) -> ActivationProfile:
    norm_ids = {id(m) for m in norms or []}
    mode = fake_mode(symbolic_items=call is not None, values=values)
    layers = [*blocks, *outer_layers_of(model, blocks, [("", m) for m in norms or []])]
    with fake_parameters(model, mode, compute, lambda m: id(m) in norm_ids, values), \
            _fp32_norm_hooks(norms or [], compute), _inputs_cast(layers, compute):  # before the recorder's hooks
        fake_input = tree_map(lambda v: v if not isinstance(v, torch.Tensor) else fake_batch_tensor(
            v, (batch_dtype or v.dtype) if v.is_floating_point() else v.dtype, mode, values is not None), example_input)
        real = tensors_of(example_input)
        batch_bytes = sum(t.numel() * t.element_size() for t in real)
        # The batch is resident before the step (``batch_bytes``): a layer saving it keeps nothing new, unless the
        # step casts it to the compute dtype first (a copy, which counts).
        uncast = [fake for t, fake in zip(real, tensors_of(fake_input)) if t.dtype == fake.dtype]
        excluded = {storage_id(p) for p in model.parameters()} | {storage_id(t) for t in uncast}
        recorder = _Recorder(excluded)
        block_ids = {id(m) for _, b in blocks for m in b.modules()}
        outer_params = {storage_id(p): p.numel() * compute.itemsize for m in model.modules() if id(m) not in block_ids
                        for p in m.parameters(recurse=False) if p.requires_grad}
        outer_use = _OuterParameterUse(outer_params, recorder)
        handles = [h for i, (_, b) in enumerate(blocks) for h in (
            b.register_forward_pre_hook(recorder.enter(i), with_kwargs=True), b.register_forward_hook(recorder.leave))]
        handles += [h for i, (_, b) in enumerate(blocks) for h in (all_reduces.watching(i, b) if all_reduces else [])]
        with removing(handles), mode, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), outer_use:
            if call is not None:
                out = call(model, fake_input)
            else:
                out = model(*fake_input) if isinstance(fake_input, tuple) else model(fake_input)
        outputs = [t for t in tensors_of(out) if t.is_floating_point()]
        no_gradient = parameters_without_gradient(model, outputs) if call is not None else None  # a step's loss
        context = (compute, call is not None, torch.are_deterministic_algorithms_enabled())
        if sum(map(len, _PASSES.values())) > 20_000:  # bounded: a long sweep over ever new architectures
            _PASSES.clear()
        # A run on real values may meet shapes that follow them: its numbers are its own, never shared.
        measured = _PASSES.setdefault(context, {}) if values is None else {}
        calling = blocks_calling_blocks(blocks)
        settled = [(mode_of(i, name, block) or "none") if mode_of else None for i, (name, block) in enumerate(blocks)]
        results = [block_memory(name, block, recorder.calls_of(i), i, mode, measured,
                                modes_to_measure(name, settled[i], calling), all_reduces)
                   for i, (name, block) in enumerate(blocks)]
        output_bytes = sum(t.numel() * t.element_size() for t in outputs)  # its gradient, held through backward
        return concrete(ActivationProfile(
            blocks=results,
            outer_saved=recorder.saved_by(None),
            outer_saved_after=recorder.saved_after_blocks(),
            outer_backward=outer_use.used_after_blocks() + 2 * output_bytes,
            batch_bytes=batch_bytes,
            order=tuple(recorder.sequence),
            without_gradient=no_gradient,
        ))
