"""Kernel mechanisms (per-block compile, attention backend, fused optimizer) and the only dynamo config."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vitscale._compat import dynamo, fused_kernel_devices
from lightning_vitscale.policies import ATTENTION_CHOICES, COMPILE_MODES, KernelPolicy

# dynamo's default number of compiled variants per code object (requires_grad, shapes, ...), per block class.
_VARIANTS_PER_CLASS = 8

# SGD has a fused step too, but DTensor registers no sharding rule for `aten._fused_sgd_` (torch 2.14:
# "does not have a sharding strategy registered"), so a sharded SGD would fail at its first step.
_FUSED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


# --- per-block compilation -------------------------------------------------------------------------------


def apply_regional_compile(blocks: list[nn.Module], mode: str | None = None) -> dict[str, int]:
    """Compile each block in place; returns block class name -> number of blocks compiled.

    ``nn.Module.compile`` keeps parameter names (``torch.compile(module)`` would add ``_orig_mod.`` to every
    state-dict key). Call it after activation checkpointing (dynamo traces the checkpoint into a recompute
    region, so the memory saving survives) and before ``fully_shard`` (FSDP's hooks then run eagerly around
    the compiled block). Identical blocks share compiled code through dynamo's cache: one compile per class
    (plus one variant when only the first block's input does not require grad). Sets two dynamo options,
    see :func:`_configure_dynamo`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"`mode={mode!r}` is not supported with FSDP2; choose one of {COMPILE_MODES}.")
    counts: Counter[str] = Counter()
    for block in blocks:
        block.compile(mode=mode)
        counts[type(block).__name__] += 1
    _configure_dynamo(len(counts))
    return dict(counts)


def _configure_dynamo(num_classes: int) -> None:
    """The only dynamo config changes in the package; global because dynamo reads them at the first call.

    1. Every checkpointed block runs through one wrapper function, so all block classes share its budget of
       compiled variants; give each class its own, or dynamo silently runs the extra ones eagerly.
    2. The fp32-norm hooks (norms.py) swap a norm's parameters for local tensors in forward and swap them back.
       Dynamo refuses such side effects inside a checkpoint region (it could not replay them on recompute), so
       without this the whole block graph-breaks and runs eagerly: measured here, a bf16 block compiled to
       nothing. Not replaying is right for these net-zero swaps, and for user side effects (a counter) it avoids
       counting twice, which eager recompute does.
    """
    needed = _VARIANTS_PER_CLASS * max(num_classes, 1)
    if dynamo.config.recompile_limit < needed:
        dynamo.config.recompile_limit = needed
    dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


# --- attention ------------------------------------------------------------------------------------------


def xformers_available() -> bool:
    """Whether the optional ``xformers`` extra imports (it has no CPU kernels, so it only matters on CUDA)."""
    try:
        import xformers.ops  # noqa: F401
    except Exception:  # ImportError, or a wheel built for another torch raising at import
        return False
    return True


def sdpa_via_xformers(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, scale: float | None = None
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v)`` computed by xformers; (batch, heads, seq, dim) layout in and out."""
    import xformers.ops as xops

    out = xops.memory_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p=dropout_p, scale=scale
    )
    return out.transpose(1, 2)


def choose_attention(
    policy: KernelPolicy, q_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[str, dict[str, float]]:
    """Pick the attention kernel for (batch, heads, seq, head_dim) inputs; returns the name and ms per fwd+bwd.

    Only ``"auto"`` on CUDA with xformers installed measures anything; everything else is decided without
    running a kernel. SDPA's memory-efficient backend *is* xformers' kernel and flash usually beats both,
    so ``"sdpa"`` wins unless the measurement says otherwise on this GPU and shape.
    """
    match policy.attention:
        case "sdpa":
            return "sdpa", {}
        case "xformers":
            if device.type != "cuda" or not xformers_available():
                raise RuntimeError("attention='xformers' needs a CUDA device and `pip install xformers`.")
            return "xformers", {}
        case "auto" if device.type == "cuda" and xformers_available():
            timings = {
                "sdpa": _time_attention(F.scaled_dot_product_attention, q_shape, dtype, device),
                "xformers": _time_attention(sdpa_via_xformers, q_shape, dtype, device),
            }
            return min(timings, key=timings.__getitem__), timings
        case "auto":
            return "sdpa", {}
        case other:
            raise ValueError(f"attention={other!r} is not one of {', '.join(ATTENTION_CHOICES)}.")


def _time_attention(fn, q_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, iters: int = 10) -> float:
    """Median milliseconds of one forward+backward, timed with CUDA events after warm-up."""
    q, k, v = (torch.randn(q_shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(q, k, v).sum().backward()
        end.record()
        torch.cuda.synchronize(device)
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


# --- fused optimizer ------------------------------------------------------------------------------------


def fuse_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> list[str]:
    """Set ``fused=True`` on Adam/AdamW param groups where the user left both ``fused`` and ``foreach`` unset.

    Hyper-parameters and groups are kept. Call before any step (fused keeps its step counter on the parameter
    device) and before ``prefer_foreach`` (which then leaves fused groups alone). Groups holding parameters
    on a device without fused kernels, non-float parameters, or ``differentiable=True`` are left as they are.
    Returns one line per changed optimizer.
    """
    supported = set(fused_kernel_devices())
    changed = []
    for index, optimizer in enumerate(optimizers):
        if type(optimizer) not in _FUSED_OPTIMIZERS:
            continue
        groups = [g for g in optimizer.param_groups if _can_fuse(g, supported)]
        for group in groups:
            group["fused"], group["foreach"] = True, False
        if groups:
            optimizer.defaults["fused"], optimizer.defaults["foreach"] = True, False
            changed.append(
                f"optimizer {index} ({type(optimizer).__name__}): fused=True in {len(groups)}"
                f" of {len(optimizer.param_groups)} param group(s)"
            )
    return changed


def _can_fuse(group: dict, supported: set[str]) -> bool:
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return False
    params = group["params"]
    return bool(params) and all(p.device.type in supported and torch.is_floating_point(p) for p in params)
