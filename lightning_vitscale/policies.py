"""Policy: frozen dataclasses saying *what* to shard and checkpoint, with no torch.distributed import."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import nn

from lightning_vitscale.matching import is_normalization

ModuleSelector = set[type[nn.Module]] | frozenset[type[nn.Module]] | Callable[[str, nn.Module], bool]
"""Block classes, or a predicate on (qualified name, module)."""

CheckpointSelector = bool | int | Callable[[str, nn.Module], bool]
"""``True``: every block; ``False``: none; ``k``: every k-th block (1-based); callable: per block."""


@dataclass(frozen=True)
class ShardingPolicy:
    """Which modules become their own FSDP unit and when they free gathered parameters.

    Attributes:
        blocks: ``None`` finds the repeated blocks automatically; a set of classes or a predicate overrides it.
        reshard_after_forward: ``None`` is the recipe (blocks free their gathered parameters after forward, the
            root keeps its own for backward); ``True``/``False`` force it for every unit; an ``int`` reshards
            blocks to that smaller world size (FSDP2 hybrid reshard).
    """

    blocks: ModuleSelector | None = None
    reshard_after_forward: bool | int | None = None

    def __post_init__(self) -> None:
        if self.blocks is not None and not (callable(self.blocks) or isinstance(self.blocks, (set, frozenset))):
            raise TypeError(
                f"`blocks` must be None, a set of nn.Module classes or a callable (name, module) -> bool;"
                f" got {type(self.blocks).__name__}. Example: VitScaleStrategy(blocks={{MyBlock}})."
            )
        if isinstance(self.blocks, (set, frozenset)):
            bad = [b for b in self.blocks if not (isinstance(b, type) and issubclass(b, nn.Module))]
            if bad or not self.blocks:
                raise TypeError(
                    f"`blocks` must contain nn.Module subclasses; got {bad or 'an empty set'}."
                    " Pass the block classes themselves, e.g. blocks={TransformerEncoderLayer}."
                )
        rf = self.reshard_after_forward
        if rf is not None and not isinstance(rf, (bool, int)):
            raise TypeError(f"`reshard_after_forward` must be None, a bool or an int; got {rf!r}.")
        if isinstance(rf, int) and not isinstance(rf, bool) and rf < 1:
            raise ValueError(f"`reshard_after_forward` as an int is a world size and must be >= 1; got {rf}.")


@dataclass(frozen=True)
class CheckpointingPolicy:
    """Which blocks recompute their activations in backward instead of storing them.

    Attributes:
        blocks: see :data:`CheckpointSelector`.
    """

    blocks: CheckpointSelector = True

    def __post_init__(self) -> None:
        sel = self.blocks
        if isinstance(sel, bool) or callable(sel):
            return
        if isinstance(sel, int):
            if sel < 1:
                raise ValueError(
                    f"`activation_checkpointing={sel}` is not valid: an int k checkpoints every k-th block and must"
                    " be >= 1 (use False to turn checkpointing off)."
                )
            return
        raise TypeError(
            f"`activation_checkpointing` must be True, False, an int k >= 1 or a callable (name, module) -> bool;"
            f" got {sel!r}."
        )

    def selects(self, index: int, name: str, module: nn.Module) -> bool:
        """Whether the ``index``-th block (0-based, in model order) is checkpointed."""
        sel = self.blocks
        if isinstance(sel, bool):
            return sel
        if isinstance(sel, int):
            return (index + 1) % sel == 0
        return bool(sel(name, module))


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
        compile_blocks: ``torch.compile`` each repeated block in place (regional compilation): identical blocks
            share one compiled graph, so compile time is one block's, not the whole model's.
        compile_outer: also compile the largest sub-modules outside the blocks (patch embedding, head, ...),
            each in place. Off in every preset: they are a small share of the time, and each is one more compile.
        attention: ``"sdpa"`` keeps ``F.scaled_dot_product_attention`` (which itself picks flash /
            memory-efficient kernels); ``"xformers"`` routes the blocks' SDPA calls to xformers; ``"auto"``
            times SDPA against xformers on the shapes the first training step used and keeps the faster
            (only where xformers can run: CUDA with the extra installed; elsewhere it is SDPA at no cost).
        fused_optimizer: switch Adam/AdamW to their fused (single-kernel) step where the user left it open.
        compile_mode: passed to ``torch.compile``; one of :data:`COMPILE_MODES`.
    """

    compile_blocks: bool = False
    compile_outer: bool = False
    attention: AttentionChoice = "sdpa"
    fused_optimizer: bool = False
    compile_mode: str | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"`attention={self.attention!r}` is not one of {', '.join(ATTENTION_CHOICES)}.")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"`compile_mode={self.compile_mode!r}` is not supported with FSDP2; choose one of {COMPILE_MODES}"
                " (CUDA-graph modes conflict with FSDP's per-step parameter gathering)."
            )


EAGER = KernelPolicy()


def resolve_kernels(spec: KernelMode | KernelPolicy, device: torch.device) -> KernelPolicy:
    """Turn ``kernels=`` into a policy for ``device``; the one place that decides what ``"auto"`` means.

    ``"auto"`` on CUDA compiles each block, fuses the optimizer and times the attention kernels. On CPU it
    is eager: the first compile of a block costs 30-60 s on a 2-core CPU for ~1.1-1.3x afterwards, and a fused
    optimizer rounds differently from DDP's foreach step, which would break the bit-exact DDP parity that CPU
    runs are used to check. Pass a :class:`KernelPolicy` to choose otherwise.
    """
    if isinstance(spec, KernelPolicy):
        return spec
    match spec:
        case "eager":
            return EAGER
        case "auto" if device.type == "cuda":
            return KernelPolicy(compile_blocks=True, attention="auto", fused_optimizer=True)
        case "auto":
            return EAGER
        case _:
            raise ValueError(
                f"`kernels={spec!r}` is not supported. Choose one of: {', '.join(KERNEL_MODES)}, or a KernelPolicy."
            )


InitMode = Literal["auto", "exact", "meta"]
INIT_MODES: tuple[str, ...] = get_args(InitMode)


def resolve_init(mode: str, full_bytes: int, available_bytes: int | None, host_copies: float = 1.0) -> str:
    """Which way a model created in ``configure_model`` gets its initial weights; the one place "auto" is decided.

    ``"exact"``: rank 0 builds the model for real and every unit's shards are scattered from it as it is sharded,
    so the weights equal DDP's bit for bit; it needs one full copy in rank 0's host memory. ``"meta"``: every rank
    builds on the meta device and runs the model's own init on its shards (same distributions, other values).
    ``"auto"`` is exact when ``host_copies`` x the model (rank 0's full copy plus the shards the host's other ranks
    keep in host memory) fits in 80% of the host's available memory, else meta; unknown memory means exact.
    """
    match mode:
        case "exact" | "meta":
            return mode
        case "auto":
            fits = available_bytes is None or full_bytes * host_copies <= 0.8 * available_bytes
            return "exact" if fits else "meta"
        case _:
            raise ValueError(
                f"`init={mode!r}` is not supported. Choose one of: {', '.join(INIT_MODES)}"
                " (e.g. VitScaleStrategy(init=\"exact\") for DDP's initial weights bit for bit)."
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Everything the parallelize pipeline needs to know, grouped so the strategy constructor stays short."""

    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)
    checkpointing: CheckpointingPolicy = field(default_factory=CheckpointingPolicy)
    kernels: KernelPolicy = field(default_factory=KernelPolicy)


PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
SUPPORTED_FLAGS: tuple[str, ...] = get_args(PrecisionFlag)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype where.

    Attributes:
        name: the Trainer-style flag this came from.
        master: dtype of the sharded parameters the optimizer updates (and of its state).
        compute: dtype units compute in (their parameters are all-gathered in it).
        reduce: dtype gradients are reduced in across ranks.
        norm_dtype: dtype normalization layers keep for parameters and compute; ``None`` lets them follow
            the rest of the model.
        norms: which modules are normalization layers (predicate on (name, module)).
        loss_scaling: whether gradients need a dynamic loss scaler (fp16).
    """

    name: str
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    norm_dtype: torch.dtype | None = torch.float32
    norms: Callable[[str, nn.Module], bool] | None = is_normalization
    loss_scaling: bool = False

    @property
    def separate_norms(self) -> bool:
        """Norms need their own handling only where they would otherwise get another dtype."""
        return self.norm_dtype is not None and self.norms is not None and (
            self.compute != self.norm_dtype or self.master != self.norm_dtype
        )


def resolve_flag(flag: str) -> PrecisionPolicy:
    """One place that turns a precision string into dtypes; anything unknown is an error naming the choices."""
    match flag:
        case "32-true":
            return PrecisionPolicy(flag, torch.float32, torch.float32, torch.float32)
        case "bf16-mixed":
            # O2: bf16 compute, fp32 master weights and optimizer state, fp32 gradient reduction.
            return PrecisionPolicy(flag, torch.float32, torch.bfloat16, torch.float32)
        case "bf16-true":
            return PrecisionPolicy(flag, torch.bfloat16, torch.bfloat16, torch.bfloat16)
        case "16-mixed":
            return PrecisionPolicy(flag, torch.float32, torch.float16, torch.float32, loss_scaling=True)
        case _:
            raise ValueError(
                f"VitScaleStrategy does not support precision={flag!r}. Choose one of: {', '.join(SUPPORTED_FLAGS)}."
            )
