"""One block measured alone on fake tensors, on the arguments the whole forward gave it: its forward and backward
under each checkpointing mode as the strategy applies it (peaks counted by :class:`LiveBytes`), its forward's work
and a full recompute's. The whole forward, and what each block saved in it, is ``activations.py``'s."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_vitscale._compat import (
    FakeTensorMode,
    StorageWeakRef,
    TorchDispatchMode,
    dtensor_local,
    storage_id,
    tree_map,
)
from lightning_vitscale.discovery.caches import is_key_value_cache
from lightning_vitscale.discovery.calls import TensorSpec
from lightning_vitscale.memory.block_identity import block_key
from lightning_vitscale.memory.op_costs import BlockWork, OpWork, tensors_of
from lightning_vitscale.memory.selective_ops import (
    SelectiveCheckpointingError,
    calls_another_block_error,
    selective_contexts,
)

if TYPE_CHECKING:
    from lightning_vitscale.memory.tensor_split import AllReduceLog

_CPU = torch.device("cpu")

ALL_MODES: frozenset[str] = frozenset({"none", "full", "selective"})


@dataclass(frozen=True)
class BlockMemory:
    """One block's activation bytes for the measured batch (``modes``: what it was measured for; the others' fields
    are 0 and predicting them is an error).

    ``saved``: kept for backward when not checkpointed (by all its calls); ``input``: kept when checkpointed, per
    call; ``backward``: what its backward holds beyond what it kept (incoming gradient, activation and parameter
    gradients), net of what it frees; ``recompute``: a checkpointed block's peak from its input through recompute
    and backward; ``selective_*``: kept per call (input and expensive ops' outputs) and its backward beyond that;
    ``work``: its forward's, every call's; ``resent``: per checkpointing mode, the row-wise bytes its recompute
    all-reduces again (tensor parallelism); ``calls``: how many times the step ran it (a block every layer shares
    runs once per layer, a backbone DINO runs on each crop size once per size: each call keeps its own input, and
    backward recomputes one call at a time); ``share``: those calls' inputs over the measured call's (the largest),
    what the per-call fields scale by to count them all (every call alike: ``calls``); ``first_saved`` and
    ``first_share``: the first call's alone (its backward runs last: a backbone run on two crop sizes holds only the
    first pass's activations by then).
    """

    name: str
    saved: int
    input: int
    backward: int
    recompute: int
    selective_saved: int = 0
    selective_backward: int = 0
    work: BlockWork = BlockWork()
    modes: frozenset[str] = ALL_MODES
    resent: dict[str, int] = field(default_factory=dict)
    calls: int = 1
    share: float = 1.0
    first_saved: int | None = None  # what the first call saved, not checkpointed (``None``: one call, ``saved``)
    first_share: float = 1.0  # the first call's input over the measured call's


class LiveBytes(TorchDispatchMode):
    """Bytes of the live storages ops created while active, and their high-water mark, through weak references to
    the storages (no allocator on fake tensors). Not to the tensors: a recompute's tensors are held by autograd alone,
    their Python tensors die early (that missed a third of a checkpointed TinyViT block's backward peak)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self._bound = 0  # live bytes at the last count and created since: at least those alive now

    def current(self) -> int:
        self._live = {key: entry for key, entry in self._live.items() if not entry[0].expired()}
        self._bound = sum(nbytes for _, nbytes in self._live.values())
        return self._bound

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tensors_of(out):
            local = dtensor_local(tensor)  # its memory: a DTensor's local shard
            key = storage_id(local)
            if key not in self._live or self._live[key][0].expired():  # an address freed since the last count
                storage = local.untyped_storage()
                self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                self._bound += storage.nbytes()
        if self._bound > self.peak:  # else no new peak: counting the live storages is most of this mode's time
            self.peak = max(self.peak, self.current())
        return out


def removing(handles: list[RemovableHandle]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for handle in handles:
        stack.enter_context(handle)
    return stack


Arguments = tuple[tuple[Any, ...], dict[str, Any]]
"""A block's positional and keyword arguments as its first call got them, tensors as :class:`TensorSpec`."""


def modes_to_measure(name: str, settled: str | None, calling: dict[str, str]) -> frozenset[str]:
    """The ``settled`` mode (``"none"``, ``"full"``, ``"selective"``); with ``None`` (the planner chooses) every mode,
    but selective for a block that calls another (:func:`blocks_calling_blocks`), which is an error when settled."""
    if name in calling and settled == "selective":
        raise calls_another_block_error(name, calling[name])
    if settled is not None:
        return frozenset({settled})
    return ALL_MODES - {"selective"} if name in calling else ALL_MODES


@dataclass(frozen=True)
class BlockCalls:
    """What the whole forward recorded of one block (``activations._Recorder``): its largest call's input and
    arguments, every call's input bytes, what all its calls and its first call saved for backward."""

    input: torch.Tensor | None
    arguments: Arguments | None
    sizes: list[int]
    saved: int
    first_saved: int


def block_memory(
    name: str, block: nn.Module, recorded: BlockCalls, index: int, mode: FakeTensorMode, measured: dict,
    needed: frozenset[str], all_reduces: AllReduceLog | None,
) -> BlockMemory:
    """A fake forward + backward of ``block`` per checkpointing in ``needed`` (non-reentrant, early stop, as the
    strategy applies it), its forward's work and a full recompute's; once per equal block in ``measured``."""
    x, arguments = recorded.input, recorded.arguments
    if x is None or arguments is None:  # the block never ran in this forward: it costs nothing for this batch
        return BlockMemory(name, 0, 0, 0, 0)
    sizes = recorded.sizes
    share = sum(sizes) / max(sizes)  # the step's calls in units of the measured one (2 of 2 alike: 2.0)
    size = x.untyped_storage().nbytes()  # a view's whole storage is what a checkpoint keeps
    roles = None if all_reduces is None else tuple(sorted(all_reduces.roles[index].items()))
    key = block_key(block, arguments), size, roles
    for kind in sorted(needed):  # the first pass counts the forward's work; a full one its recompute's too
        if (key, kind) in measured:
            continue
        # Below the checkpoint's own caching mode, the counter sees every op it caches (selective's saved bytes).
        work = OpWork() if (key, "work") not in measured or kind == "selective" else None
        resent: list[int] = []
        watch = None if all_reduces is None else functools.partial(all_reduces.watching, index, block, resent)
        if kind == "none":
            measured[key, kind] = peak_beyond_forward(block, arguments, mode, None, work)
        elif kind == "full":
            repeated = OpWork()  # the recompute's own context: what backward really reruns
            contexts = functools.partial(lambda r: (contextlib.nullcontext(), r), repeated)
            measured[key, kind] = peak_beyond_forward(block, arguments, mode, contexts, work, watch) + size
            measured[key, "recompute"] = repeated.result()
        else:
            assert work is not None
            try:
                selective = peak_beyond_forward(block, arguments, mode, selective_contexts, work, watch)
            except RuntimeError as error:  # an in-place op on an output it keeps (torchvision's SE: SiLU(inplace))
                if "selective activation checkpoint" not in str(error):
                    raise
                if needed == {"selective"}:  # asked for: it would fail at the first backward
                    raise SelectiveCheckpointingError(
                        f"{name} cannot be checkpointed selectively: its forward changes in place an output that"
                        f" selective checkpointing keeps ({error}; e.g. an inplace activation after a convolution)."
                        " Give it activation_checkpointing='full' (a callable may choose per block), or build its"
                        " activation with inplace=False."
                    ) from error
                measured[key, kind], measured[key, "resent", kind] = None, 0
                continue
            measured[key, kind] = (work.saved_bytes + size, selective)
        measured[key, "resent", kind] = sum(resent)
        if work is not None:
            measured.setdefault((key, "work"), work.result())
    needed = frozenset(kind for kind in needed if measured[key, kind] is not None)  # what the block can run
    passes = {kind: measured[key, kind] for kind in needed}
    selective_saved, selective_backward = passes.get("selective", (0, 0))
    return BlockMemory(
        name,
        saved=recorded.saved,
        input=size,
        backward=passes.get("none", 0),
        recompute=passes.get("full", 0),
        selective_saved=selective_saved,
        selective_backward=selective_backward,
        work=dataclasses.replace(measured.get((key, "work"), BlockWork()),
                                 recompute=measured.get((key, "recompute"))).times(share),
        modes=needed,
        resent={kind: round(measured[key, "resent", kind] * share) for kind in needed if kind != "none"},
        calls=len(sizes),
        share=share,
        first_saved=recorded.first_saved if len(sizes) > 1 else None,
        first_share=sizes[0] / max(sizes),
    )


def peak_beyond_forward(
    block: nn.Module, arguments: torch.Tensor | Arguments, mode: FakeTensorMode, checkpoint: Callable[[], Any] | None,
    work: OpWork | None = None, watch: Callable[[], list[RemovableHandle]] | None = None,
) -> int:
    """Peak bytes of the block's backward above what its forward left alive, called on ``arguments`` (or a tensor
    alone); ``checkpoint``: the ``context_fn`` it runs under ``torch.utils.checkpoint`` with; ``work``: counts the
    forward; ``watch``: hooks for the backward (the recompute). Selective checkpointing's cached outputs are detached
    aliases :class:`LiveBytes` misses: ``work.saved_bytes`` has them."""
    if isinstance(arguments, torch.Tensor):
        arguments = ((spec(arguments, arguments),), {})
    with mode:
        args, kwargs = made(arguments)  # not the block's work
    with work if work is not None else contextlib.nullcontext():  # first: below the checkpoint's own modes
        with mode:
            tracker = LiveBytes()
            with tracker:
                out = (block(*args, **kwargs) if checkpoint is None else torch.utils.checkpoint.checkpoint(
                    block, *args, use_reentrant=False, context_fn=checkpoint, **kwargs))
                first = next(t for t in tensors_of(out) if t.requires_grad)
                base = tracker.peak = tracker.current()
                if work is not None:
                    work.counting = False
                # The gradient flowing in from the layers above is alive through the block's backward (a residual
                # passes it on as it is): part of what the backward holds beyond the forward.
                with removing(watch() if watch is not None else []):
                    torch.autograd.backward(first, torch.empty_like(first))
    for p in block.parameters():
        p.grad = None
    return tracker.peak - base


def spec(value: Any, first: torch.Tensor) -> Any:
    """A recorded argument: a tensor as its :class:`TensorSpec`; ``first`` (the block's input) requires grad, as the
    step's activations do (the model's input, the first block's, need not: blocks alike are measured once)."""
    if is_key_value_cache(value):  # replayed, the block would append to the whole forward's cache (caches.py)
        return None
    if not isinstance(value, torch.Tensor):
        return value
    grad = value is first or (value.requires_grad and value.is_floating_point())
    return TensorSpec(tuple(value.shape), value.dtype, grad)


def made(arguments: Arguments) -> Arguments:
    """Fresh fake tensors for the recorded ``arguments``, with no autograd history from the whole forward."""
    return tree_map(lambda v: torch.empty(v.shape, dtype=v.dtype, device=_CPU, requires_grad=v.requires_grad)
                    if isinstance(v, TensorSpec) else v, arguments)
