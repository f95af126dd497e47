"""Policy: frozen dataclasses saying *what* to shard and checkpoint, with no torch.distributed import."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch
from torch import nn

from lightning_vitscale.matching import is_normalization

ModuleSelector = set[type[nn.Module]] | frozenset[type[nn.Module]] | Callable[[str, nn.Module], bool]
"""Block classes, or a predicate on (qualified name, module)."""

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Turns a function into its compiled version, like ``torch.compile(fn)`` or a compiled module's ``dynamo_ctx``."""

CheckpointSelector = bool | int | Literal["auto"] | Callable[[str, nn.Module], bool]
"""``True``: every block; ``False``: none; ``k``: every k-th block (1-based); callable: per block; ``"auto"``: the
fewest blocks that keep the predicted step peak within ``memory_budget`` (chosen once the batch is known)."""

ShardingLayout = Literal["full", "hybrid"] | int
"""``"full"``: shard over every rank; ``"hybrid"``: shard inside each node, replicate across nodes; an ``int``:
shard over groups of that many consecutive ranks, replicate across the groups."""

SHARDING_LAYOUTS: tuple[str, ...] = ("full", "hybrid")
OffloadMode = Literal["cpu"]
"""``"cpu"``: sharded parameters, gradients and optimizer state live in host memory between uses."""
OFFLOAD_CHOICES: tuple[str | None, ...] = (None, "cpu")


@dataclass(frozen=True)
class ShardingPolicy:
    """Which modules become their own FSDP unit and when they free gathered parameters.

    Attributes:
        blocks: ``None`` finds the repeated blocks automatically; a set of classes or a predicate overrides it.
        layout: which ranks share one copy of the state, see :data:`ShardingLayout` and :func:`shard_group_size`.
        offload: ``"cpu"`` keeps the sharded parameters, gradients and optimizer state in host memory (FSDP2's
            ``CPUOffloadPolicy``); the optimizer then steps on the CPU.
        reshard_after_forward: ``None`` is the recipe (blocks free their gathered parameters after forward, the
            root keeps its own for backward); ``True``/``False`` force it for every unit; an ``int`` reshards
            blocks to that smaller world size (FSDP2 hybrid reshard).
    """

    blocks: ModuleSelector | None = None
    reshard_after_forward: bool | int | None = None
    layout: ShardingLayout = "full"
    offload: OffloadMode | None = None

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(
                f"`offload={self.offload!r}` is not supported. Choose one of: {OFFLOAD_CHOICES} (\"cpu\" keeps sharded"
                " parameters, gradients and optimizer state in host memory)."
            )
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


def _check_layout(layout: object) -> None:
    if isinstance(layout, bool) or not isinstance(layout, (str, int)):
        raise TypeError(f"`sharding` must be one of {SHARDING_LAYOUTS} or a shard-group size (int); got {layout!r}.")
    if isinstance(layout, str) and layout not in SHARDING_LAYOUTS:
        raise ValueError(
            f"`sharding={layout!r}` is not supported. Choose one of: {', '.join(map(repr, SHARDING_LAYOUTS))},"
            " or an int that divides the world size (ranks per shard group)."
        )
    if isinstance(layout, int) and layout < 1:
        raise ValueError(f"`sharding={layout}` is a shard-group size and must be >= 1.")


def shard_group_size(layout: ShardingLayout, world_size: int, ranks_per_node: int) -> int:
    """How many ranks shard one copy of the state: the one place that says what each layout means.

    ``"full"`` shards over all ranks (least memory: 1/world of the state per rank, but every unit's all-gather
    and reduce-scatter spans the nodes). ``"hybrid"`` shards over the ranks of one node (fast intra-node links
    carry every all-gather and reduce-scatter; only one gradient all-reduce of each rank's shard crosses
    nodes) and keeps a replica per node. An int must divide ``world_size``.
    """
    _check_layout(layout)
    match layout:
        case "full":
            return world_size
        case "hybrid":
            size = ranks_per_node
            how = f"`sharding=\"hybrid\"` shards within each node ({ranks_per_node} ranks per node)"
        case _:
            size = int(layout)
            how = f"`sharding={layout}` asks for shard groups of {layout} ranks"
    if size > world_size or world_size % size != 0:
        raise ValueError(
            f"{how}, which does not divide the world size {world_size}. Choose one of: 'full', 'hybrid', or an int"
            f" among {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )
    return size


@dataclass(frozen=True)
class CheckpointingPolicy:
    """Which blocks recompute their activations in backward instead of storing them.

    Attributes:
        blocks: see :data:`CheckpointSelector`.
        memory_budget: only with ``blocks="auto"``: bytes a training step may use per rank (an int), or a
            fraction of the device's memory (a float in (0, 1]; CPU: of the host's available memory divided
            among the local ranks). ``None`` is 0.9.
    """

    blocks: CheckpointSelector = True
    memory_budget: int | float | None = None

    def __post_init__(self) -> None:
        sel = self.blocks
        self._check_budget()
        if sel == "auto" or isinstance(sel, bool) or callable(sel):
            return
        if isinstance(sel, int):
            if sel < 1:
                raise ValueError(
                    f"`activation_checkpointing={sel}` is not valid: an int k checkpoints every k-th block and must"
                    " be >= 1 (use False to turn checkpointing off)."
                )
            return
        raise TypeError(
            f"`activation_checkpointing` must be True, False, an int k >= 1 or a callable (name, module) -> bool,"
            f" or 'auto'; got {sel!r}."
        )

    def _check_budget(self) -> None:
        budget = self.memory_budget
        if budget is None:
            return
        if self.blocks != "auto":
            raise ValueError(
                f"`memory_budget={budget!r}` is only used by activation_checkpointing='auto'; got"
                f" activation_checkpointing={self.blocks!r}. Pass activation_checkpointing='auto' or drop"
                " memory_budget."
            )
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"`memory_budget` must be an int (bytes) or a float fraction in (0, 1]; got {budget!r}.")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(
                f"`memory_budget={budget}` as a float is a fraction of device memory and must be in (0, 1];"
                " give bytes as an int, e.g. memory_budget=30 * 2**30."
            )
        if isinstance(budget, int) and budget < 1:
            raise ValueError(f"`memory_budget={budget}` bytes must be >= 1.")

    @property
    def is_auto(self) -> bool:
        return self.blocks == "auto"

    def selects(self, index: int, name: str, module: nn.Module) -> bool:
        """Whether the ``index``-th block (0-based, in model order) is checkpointed.

        ``"auto"`` selects nothing here: the strategy checkpoints its chosen blocks once it knows the batch.
        """
        sel = self.blocks
        if sel == "auto":
            return False
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
        compiler: compiles each module's call instead of ``torch.compile(mode=compile_mode)``; set when the user
            passes ``trainer.fit(torch.compile(model, ...))``, so their backend and options apply per block.
    """

    compile_blocks: bool = False
    compile_outer: bool = False
    attention: AttentionChoice = "sdpa"
    fused_optimizer: bool = False
    compile_mode: str | None = None
    compiler: Compiler | None = field(default=None, compare=False)

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
    """Turn ``kernels=`` into a policy for ``device``; with :func:`resolve_attention`, the one place that decides
    what ``"auto"`` means.

    ``"auto"`` on CUDA compiles each block, fuses the optimizer and times the attention kernels. On CPU it
    is eager: the first compile of a block costs 30-60 s on a 2-core CPU for ~1.1-1.3x afterwards, and a fused
    optimizer rounds differently from DDP's foreach step, which would break the bit-exact DDP parity that CPU
    runs are used to check. Pass a :class:`KernelPolicy` to choose otherwise. ``attention_backends`` names the
    attention kernels that can run on ``device`` (see ``attention.usable_backends``). Resolving a resolved
    policy returns it unchanged.
    """
    policy = spec if isinstance(spec, KernelPolicy) else _preset(spec, device)
    attention = resolve_attention(policy.attention, attention_backends, device)
    return policy if attention == policy.attention else replace(policy, attention=attention)


def _preset(mode: str, device: torch.device) -> KernelPolicy:
    match mode:
        case "eager":
            return EAGER
        case "auto" if device.type == "cuda":
            return KernelPolicy(compile_blocks=True, attention="auto", fused_optimizer=True)
        case "auto":
            return EAGER
        case _:
            raise ValueError(
                f"`kernels={mode!r}` is not supported. Choose one of: {', '.join(KERNEL_MODES)}, or a KernelPolicy."
            )


def resolve_attention(choice: str, usable: tuple[str, ...], device: torch.device) -> AttentionChoice:
    """What ``attention=choice`` means where the kernels named in ``usable`` can run.

    ``"sdpa"`` needs nothing: SDPA already dispatches to flash / memory-efficient kernels. ``"auto"`` stays
    ``"auto"`` (timed against SDPA after the first step) only where some candidate can run (xformers: CUDA with
    the extra installed); elsewhere it is SDPA at no cost. A named backend that cannot run is an error now, not
    a silent fallback.
    """
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
    """Everything the parallelize pipeline needs to know, grouped so the strategy constructor stays short.

    ``kernels`` is what was asked for (``"auto"``, ``"eager"`` or a :class:`KernelPolicy`) until the device is
    known; ``VitScaleStrategy`` replaces it with the resolved :class:`KernelPolicy` at setup.
    """

    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)
    checkpointing: CheckpointingPolicy = field(default_factory=CheckpointingPolicy)
    kernels: KernelMode | KernelPolicy = field(default_factory=KernelPolicy)


StateDictType = Literal["sharded", "full"]
STATE_DICT_TYPES: tuple[str, ...] = get_args(StateDictType)


def resolve_state_dict_type(spec: str) -> StateDictType:
    """``"sharded"``: every rank writes its own shards (a folder); ``"full"``: rank 0 writes one DDP-style file."""
    match spec:
        case "sharded":
            return "sharded"
        case "full":
            return "full"
        case _:
            raise ValueError(
                f"`state_dict_type={spec!r}` is not supported. Choose 'sharded' (a folder of per-rank shards, the"
                " default) or 'full' (one file in DDP's format that `MyModule.load_from_checkpoint` reads)."
            )


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


NormSelector = bool | set[type[nn.Module]] | Callable[[str, nn.Module], bool] | None
"""``None``/``True``: detect normalization layers; ``False``: none; a set of classes; or a predicate."""


def norm_predicate(norms: NormSelector) -> Callable[[str, nn.Module], bool] | None:
    """Turn ``VitScalePrecision(norms=...)`` into a predicate on (name, module); ``None``: no norm is special."""
    match norms:
        case None | True:
            return is_normalization
        case False:
            return None
        case set() | frozenset():
            classes = tuple(norms)
            return lambda _, module: isinstance(module, classes)
        case _ if callable(norms):
            return norms
        case _:
            raise TypeError(f"`norms` must be None, True, False, a set of classes or a callable; got {norms!r}.")


EMAEvaluate = Literal["ema", "raw", "both"]
EMABuffers = Literal["average", "copy"]


@dataclass(frozen=True)
class EMAPolicy:
    """When and how :class:`~lightning_vitscale.ShardedEMA` averages the weights (pure arithmetic, no tensors).

    Attributes:
        decay: ``ema = decay * ema + (1 - decay) * weights`` at each update, in [0, 1].
        warmup: use ``min(decay, (1 + n) / (10 + n))`` instead, ``n`` = updates done so far (TensorFlow's
            ``ExponentialMovingAverage(num_updates=...)``): early averages forget the random init quickly.
        update_every_n_steps, update_starting_at_step: update after optimizer step index ``i`` (0-based) when
            ``i >= update_starting_at_step`` and ``i % update_every_n_steps == 0``, as Lightning's
            ``EMAWeightAveraging``; the first update copies the weights.
        buffers: ``"average"`` floating buffers like the weights (integer ones are copied), or ``"copy"`` them.
        evaluate: which weights validation/test use: ``"ema"``, ``"raw"`` or ``"both"`` (an EMA pass logged
            under ``ema/``, then the usual pass).
        offload: keep the EMA shards in CPU memory instead of next to the parameters.
    """

    decay: float = 0.999
    warmup: bool = False
    update_every_n_steps: int = 1
    update_starting_at_step: int = 0
    buffers: EMABuffers = "average"
    evaluate: EMAEvaluate = "both"
    offload: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"`decay` must be in [0, 1]; got {self.decay}. Typical values: 0.999 to 0.9999.")
        if self.update_every_n_steps < 1:
            raise ValueError(f"`update_every_n_steps` must be >= 1; got {self.update_every_n_steps}.")
        if self.update_starting_at_step < 0:
            raise ValueError(f"`update_starting_at_step` must be >= 0; got {self.update_starting_at_step}.")
        if self.buffers not in get_args(EMABuffers):
            raise ValueError(f"`buffers` must be one of {get_args(EMABuffers)}; got {self.buffers!r}.")
        if self.evaluate not in get_args(EMAEvaluate):
            raise ValueError(f"`evaluate` must be one of {get_args(EMAEvaluate)}; got {self.evaluate!r}.")

    def should_update(self, step_idx: int) -> bool:
        return step_idx >= self.update_starting_at_step and step_idx % self.update_every_n_steps == 0

    def decay_at(self, updates_done: int) -> float:
        """The decay of the next update; 0 for the first one, which copies the weights."""
        if updates_done == 0:
            return 0.0
        return min(self.decay, (1 + updates_done) / (10 + updates_done)) if self.warmup else self.decay
