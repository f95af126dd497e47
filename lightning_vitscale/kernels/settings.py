"""Which faster kernels to use (``kernels=``): compile, attention backend, fused optimizer; what "auto" means."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Turns a function into its compiled version, like ``torch.compile(fn)`` or a compiled module's ``dynamo_ctx``."""

AttentionChoice = Literal["auto", "sdpa", "xformers"]
KernelMode = Literal["auto", "eager"]
KERNEL_MODES: tuple[str, ...] = get_args(KernelMode)
ATTENTION_CHOICES: tuple[str, ...] = get_args(AttentionChoice)

# CUDA-graph modes replay fixed memory addresses; FSDP2 frees and re-gathers parameters every step, so
# "reduce-overhead"/"max-autotune" (which use CUDA graphs) are refused rather than left to fail at run time.
COMPILE_MODES: tuple[str | None, ...] = (None, "default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class KernelPolicy:
    """Which faster kernels the pipeline turns on.

    Attributes:
        compile_blocks: ``torch.compile`` each repeated block in place (identical blocks share one graph).
        compile_outer: the largest sub-modules outside the blocks too (off in every preset: little time, more compiles).
        attention: ``"sdpa"``, ``"xformers"`` (the blocks' SDPA calls routed to it) or ``"auto"`` (both timed on the
            first step's shapes, where xformers runs).
        fused_optimizer: switch Adam/AdamW to their fused step where the user left it open.
        compiler: a user's ``torch.compile(model, ...)``, used instead of ``torch.compile(mode=compile_mode)``.
        reason: why ``kernels="auto"`` compiles the blocks or not (the setup summary's words).
    """

    compile_blocks: bool = False
    compile_outer: bool = False
    attention: AttentionChoice = "sdpa"
    fused_optimizer: bool = False
    compile_mode: str | None = None
    compiler: Compiler | None = field(default=None, compare=False)
    reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"`attention={self.attention!r}` is not one of {', '.join(ATTENTION_CHOICES)}.")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"`compile_mode={self.compile_mode!r}` is not supported with FSDP2; choose one of {COMPILE_MODES}"
                " (CUDA-graph modes conflict with FSDP's per-step parameter gathering)."
            )


EAGER = KernelPolicy()


def resolve_kernels(
    spec: KernelMode | KernelPolicy, device: torch.device, attention_backends: tuple[str, ...]
) -> KernelPolicy:
    """``kernels=`` as a policy for ``device``; with :func:`resolve_attention`, the one place ``"auto"`` is decided.
    ``"auto"`` on CUDA fuses the optimizer, times the attention kernels and compiles each block unless the planner
    predicts it slower (:func:`with_compile_choice`). On CPU it is eager: a block's first compile costs 30-60 s on 2
    cores for ~1.1-1.3x, and a fused optimizer rounds unlike DDP's foreach step (CPU runs check bit-exact parity)."""
    policy = spec if isinstance(spec, KernelPolicy) else _preset(spec, device)
    attention = resolve_attention(policy.attention, attention_backends, device)
    return policy if attention == policy.attention else replace(policy, attention=attention)


def _preset(mode: str, device: torch.device) -> KernelPolicy:
    match mode:
        case "auto" if device.type == "cuda":
            return KernelPolicy(compile_blocks=True, attention="auto", fused_optimizer=True, reason=NO_BATCH)
        case "auto" | "eager":
            return EAGER
        case _:
            raise unknown_kernel_mode(mode)


NO_BATCH = "no batch known at setup to predict the step with: compiled (kernels='auto''s default)"


def with_compile_choice(policy: KernelPolicy, pays: bool, why: str) -> KernelPolicy:
    """``kernels="auto"`` with the batch known at setup: the blocks compiled only where the planner's step model
    predicts they pay (``pays``, ``memory/step_cost.compile_pays``). On one H200, ViT-H/14 at batch 32 compiled ran at
    0.75x eager (the host issues the step slower than the device runs it, and a compiled block costs the host more),
    at its largest batch 1.18x (fused elementwise ops); a rule by device type would have been wrong on one side."""
    return replace(policy, compile_blocks=pays, reason=why)


def unknown_kernel_mode(mode: object) -> ValueError:
    return ValueError(
        f"`kernels={mode!r}` is not supported. Choose one of: {', '.join(KERNEL_MODES)}, or a KernelPolicy."
    )


def resolve_attention(choice: str, usable: tuple[str, ...], device: torch.device) -> AttentionChoice:
    """What ``attention=choice`` means where ``usable`` kernels can run: ``"auto"`` only where a candidate can, else
    SDPA at no cost; a named backend that cannot run is an error now, not a silent fallback."""
    match choice:
        case "sdpa":
            return "sdpa"
        case "auto":
            return "auto" if usable else "sdpa"
        case "xformers" if choice in usable:
            return "xformers"
        case "xformers":
            raise RuntimeError(
                f"attention={choice!r} cannot run on {device}: {choice} has CUDA kernels only and must be installed"
                " (`pip install lightning-vitscale[xformers]`). Use attention='auto' to fall back to SDPA."
            )
        case _:
            raise ValueError(f"`attention={choice!r}` is not one of {', '.join(ATTENTION_CHOICES)}.")
