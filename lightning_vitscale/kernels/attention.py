"""Attention routing: send the blocks' ``F.scaled_dot_product_attention`` calls to another kernel, no model edits.

Models call SDPA by name (timm, HF ``attn_implementation="sdpa"``, hand-written blocks), so the kernel is swapped
by intercepting the call: :class:`AttentionRouter`, a ``TorchFunctionMode`` entered around each block's own forward
inside activation checkpointing, so the recompute uses the same kernel. Dynamo traces the mode into a compiled block
(free); eagerly a mode costs a Python call per op, so a router with nothing to do is never entered. ``"auto"``
records the SDPA shapes of the first (eager) training step, times each candidate on exactly those, and every rank
routes to the fastest on average (:func:`auto_attention_step`).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_vitscale.kernels.settings import resolve_attention

SDPA = "sdpa"
_MARK = "_vitscale_attention_routed"
_ROUTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

AttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, dropout_p, scale, is_causal)`` on (batch, heads, seq, head_dim) tensors, like SDPA."""


@dataclass(frozen=True)
class AttentionBackend:
    """A kernel that can stand in for SDPA on the calls :func:`routable` accepts."""

    name: str
    fn: AttentionFn
    available: Callable[[torch.device], bool]


@dataclass(frozen=True)
class AttentionCall:
    """What decides an attention kernel's speed: shapes, dtype, device and the causal/dropout variant."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    is_causal: bool
    dropout_p: float
    scale: float | None

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        extras = (", causal" if self.is_causal else "") + (f", dropout {self.dropout_p:g}" if self.dropout_p else "")
        return f"q{list(self.q)} {dtype}{extras}"


def xformers_available(device: torch.device | None = None) -> bool:
    """Whether the optional ``xformers`` extra imports; it has no CPU kernels, so only CUDA devices count."""
    if device is not None and device.type != "cuda":
        return False
    try:
        import xformers.ops  # noqa: F401
    except Exception:  # ImportError, or a wheel built for another torch raising at import
        return False
    return True


def sdpa_via_xformers(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0, scale: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v)`` computed by xformers; (batch, heads, seq, dim) in and out."""
    import xformers.ops as xops

    bias = xops.LowerTriangularMask() if is_causal else None
    out = xops.memory_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias, p=dropout_p, scale=scale
    )
    return out.transpose(1, 2)


XFORMERS = AttentionBackend("xformers", sdpa_via_xformers, xformers_available)
CANDIDATES: tuple[AttentionBackend, ...] = (XFORMERS,)
"""Backends ``attention="auto"`` measures against SDPA (a tuple so tests can substitute a CPU stand-in)."""


def usable_backends(device: torch.device) -> tuple[str, ...]:
    """Names of the candidate kernels that can run on ``device`` (xformers: CUDA with the extra installed)."""
    return tuple(b.name for b in CANDIDATES if b.available(device))


def make_router(choice: str, device: torch.device) -> AttentionRouter | None:
    """The router for ``KernelPolicy.attention`` on ``device``; ``None``: SDPA everywhere, no mode at all."""
    usable = usable_backends(device)
    match resolve_attention(choice, usable, device):
        case "sdpa":
            return None
        case "auto":
            return AttentionRouter(candidates=tuple(b for b in CANDIDATES if b.name in usable))
        case name:
            return AttentionRouter(backend=next(b for b in CANDIDATES if b.name == name))


def describe_router(router: AttentionRouter | None) -> str:
    """The setup summary's attention line (the auto choice replaces it after the first training step)."""
    if router is None:
        return f"{SDPA} (F.scaled_dot_product_attention picks flash / memory-efficient kernels itself)"
    if router.decided:
        assert router.backend is not None
        return f"{router.backend.name} (the blocks' F.scaled_dot_product_attention calls routed to it)"
    names = ", ".join(b.name for b in router.candidates)
    return f"auto: {SDPA} vs {names}, timed on the blocks' real shapes after the first training step"


def _bind_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, bool, float | None, bool]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def routable(args: tuple, kwargs: dict) -> AttentionCall | None:
    """The call's description if a stand-in computes exactly what SDPA would, else ``None``: masks, grouped-query
    attention, non-4-D layouts, mismatched batch/head/dtype, causal attention between sequences of different lengths
    (the libraries align the triangle differently) stay on SDPA."""
    q, k, v, mask, dropout_p, is_causal, scale, gqa = _bind_sdpa(*args, **kwargs)
    if mask is not None or gqa or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    same_dtype = q.dtype == k.dtype == v.dtype and q.dtype in _ROUTABLE_DTYPES
    same_batch_heads = q.shape[:2] == k.shape[:2] == v.shape[:2] and k.shape[2] == v.shape[2]
    if not same_dtype or not same_batch_heads or q.shape[3] != k.shape[3] or (is_causal and q.shape[2] != k.shape[2]):
        return None
    return AttentionCall(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, bool(is_causal), float(dropout_p), scale
    )


class AttentionRouter(TorchFunctionMode):
    """Intercepts SDPA inside the blocks; records calls, or hands routable ones to ``backend``. Calls inside
    ``nn.MultiheadAttention`` stay on SDPA (``F.multi_head_attention_forward`` reaches the mode as one call)."""

    def __init__(self, backend: AttentionBackend | None = None, candidates: tuple[AttentionBackend, ...] = ()) -> None:
        super().__init__()
        self.backend = backend
        self.candidates = candidates
        self.recording = False
        self.recorded = False
        self.decided = not candidates
        self.calls: Counter[AttentionCall] = Counter()

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Record every routable SDPA call the blocks make; run eagerly (the counter is a Python side effect)."""
        self.recording = True
        try:
            yield
        finally:
            self.recording, self.recorded = False, True

    def decide(self, name: str) -> None:
        """Route to the candidate called ``name`` from now on (``"sdpa"``: never enter the mode again)."""
        self.backend = None if name == SDPA else next(b for b in self.candidates if b.name == name)
        self.decided = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = routable(args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        if self.recording:
            self.calls[call] += 1
        if self.backend is None:
            return func(*args, **kwargs)
        q, k, v, _, dropout_p, is_causal, scale, _ = _bind_sdpa(*args, **kwargs)
        return self.backend.fn(q, k, v, dropout_p=dropout_p, scale=scale, is_causal=is_causal)


def _routed_forward(router: AttentionRouter, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Plain attributes, not a property: dynamo cannot read a property of a mode object (torch 2.14).
    if not (router.recording or router.backend is not None):
        return forward(*args, **kwargs)
    with router:
        return forward(*args, **kwargs)


def route_blocks(blocks: list[nn.Module], router: AttentionRouter) -> None:
    """Run each block's own forward under ``router``, before activation checkpointing wraps it (the instance's
    ``forward`` patched: parameter names stay; applying twice is a no-op)."""
    for block in blocks:
        if getattr(block, _MARK, False):
            continue
        block.forward = functools.partial(_routed_forward, router, block.forward)  # type: ignore[method-assign]
        setattr(block, _MARK, True)


def time_attention(fn: AttentionFn, call: AttentionCall, iters: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of one forward+backward of ``fn`` on random tensors shaped like ``call``."""
    make = functools.partial(torch.randn, dtype=call.dtype, device=call.device, requires_grad=True)
    q, k, v = make(call.q), make(call.k), make(call.v)

    def step() -> None:
        fn(q, k, v, dropout_p=call.dropout_p, scale=call.scale, is_causal=call.is_causal).sum().backward()

    times = [_timed(step, call.device) for _ in range(warmup + iters)]
    return statistics.median(times[warmup:])


def _timed(step: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    begin = time.perf_counter()
    step()
    return (time.perf_counter() - begin) * 1e3


def measure(calls: Counter[AttentionCall], backends: list[AttentionBackend]) -> dict[str, float]:
    """Milliseconds per training step each kernel would spend on ``calls``; SDPA first, the baseline (ties keep it)."""
    fns: dict[str, AttentionFn] = {SDPA: F.scaled_dot_product_attention, **{b.name: b.fn for b in backends}}
    totals = dict.fromkeys(fns, 0.0)
    for call, count in calls.items():
        for name, fn in fns.items():
            totals[name] += count * time_attention(fn, call)
    return totals


def describe_choice(choice: str, totals: dict[str, float], calls: Counter[AttentionCall]) -> str:
    """One summary line: the choice, each kernel's measured time per step, and the shapes it was measured on."""
    if not calls:
        return f"{choice} (no routable F.scaled_dot_product_attention call in the blocks' first training step)"
    timings = ", ".join(f"{name} {ms:.3f} ms" for name, ms in totals.items())
    shapes = "; ".join(f"{count} x {call.describe()}" for call, count in calls.items())
    return f"{choice} (measured attention fwd+bwd per step: {timings}; on {shapes})"


def auto_attention_step(
    router: AttentionRouter | None, step: Callable[[], Any],
    mean_over_ranks: Callable[[torch.Tensor], torch.Tensor], decided: Callable[[str], None],
) -> Any:
    """Run one training ``step``; on the first (eager: recording is plain Python), record the blocks' SDPA shapes;
    before the second, route to the fastest kernel on them, the timings averaged over ranks so every rank routes
    alike (ties keep SDPA); ``decided`` receives the summary line."""
    if router is None or router.decided:
        return step()
    if not router.recorded:
        with router.record(), torch.compiler.set_stance("force_eager"):
            return step()
    local = measure(router.calls, list(router.candidates))
    averaged = mean_over_ranks(torch.tensor(list(local.values()), dtype=torch.float64))
    totals = {name: float(ms) for name, ms in zip(local, averaged.tolist())}
    choice = min(totals, key=totals.__getitem__)
    router.decide(choice)
    line = describe_choice(choice, totals, router.calls)
    decided(line)
    rank_zero_info(f"VitScaleStrategy attention: {line}")
    return step()
