"""What to shard: the settings behind ``blocks=``, ``sharding=``, ``offload=``, ``reshard_after_forward=`` and
``find_unused_parameters=``, and the whole request with ``priority=`` (what to recompute:
``checkpointing_settings.py``), checked when they are made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from lightning_vitscale._utils import documented
from lightning_vitscale.discovery import ModuleSelector
from lightning_vitscale.discovery.tensor_plan import TensorPlanSelector
from lightning_vitscale.kernels.settings import KERNEL_MODES, KernelMode, KernelPolicy, unknown_kernel_mode
from lightning_vitscale.memory import ACCUMULATION_MODES, AccumulationMode
from lightning_vitscale.sharding.checkpointing_settings import CheckpointingPolicy, CheckpointSelector

ShardingLayout = Literal["full", "hybrid"] | int
"""What ``sharding=`` takes: :attr:`ShardingPolicy.layout`'s text says each choice."""
SHARDING_LAYOUTS: tuple[str, ...] = ("full", "hybrid")
Priority = Literal["speed", "memory"]
PRIORITIES: tuple[str, ...] = ("speed", "memory")
EVERY_BLOCK = 2**31 - 1
"""``blocks_per_unit`` under ``find_unused_parameters=True``: every block in one unit (the outer one), gathered."""
SkippedBlocks = bool | Literal["units"]
STAND_INS = "units"
OffloadMode = Literal["cpu"]
OFFLOAD_CHOICES: tuple[str | None, ...] = (None, "cpu")

def _invalid(settings: object, name: str, requirement: str) -> ValueError:
    """The error for an invalid ``name``, ending with the field's own text (restated by hand, it drifted)."""
    doc = next(f.metadata["doc"] for f in dataclasses.fields(settings) if f.name == name)  # type: ignore[arg-type]
    return ValueError(f"`{name}={getattr(settings, name)!r}` {requirement}. `{name}`: {doc}")


@dataclass(frozen=True)
class ShardingPolicy:
    """Which modules become their own FSDP unit and when they free gathered parameters (field texts: options.py)."""

    blocks: ModuleSelector | None = documented(None, (
        "``None`` finds the repeated blocks automatically; a set of block classes (``{MyBlock}``) or a predicate"
        " ``(name, module) -> bool`` overrides the discovery. Blocks are grouped into FSDP units"
        " (``blocks_per_unit``). A block whose weights every layer shares (one module called once per layer, as"
        " ALBERT's) repeats in no structure: name its class to make it a unit checkpointed at each call (the"
        " setup summary names it)."
    ))
    reshard_after_forward: bool | int | None = documented(None, (
        "``None``: the outer unit keeps its gathered parameters for backward; block units as ``priority`` says:"
        " ``\"speed\"``, the planner keeps the last units gathered for backward as far as ``memory_budget`` allows"
        " (one all-gather per unit fewer), ``\"memory\"``, they free theirs after forward (the recipe)."
        " ``True``/``False`` force it for every unit; an ``int`` reshards the blocks to that smaller world size"
        " (FSDP2 hybrid reshard)."
    ))
    layout: ShardingLayout = documented("full", (
        "``\"full\"`` shards over every rank (least memory); ``\"hybrid\"`` shards inside each node and replicates"
        " across nodes (all-gathers and reduce-scatters stay on intra-node links; only one gradient all-reduce per"
        " unit crosses nodes); an ``int`` sets the shard-group size (consecutive ranks; it must divide the world)."
    ))
    tensor_parallel: int = documented(1, (
        "Ranks that split each block's matmuls (tensor parallelism, Megatron style; consecutive ranks, so a group"
        " stays inside a node). ``k > 1`` makes a 2-D mesh (data parallel x tensor parallel): each block's attention"
        " heads and MLP hidden units are split over its group's ``k`` ranks, then FSDP shards it over the ``world /"
        " k`` data-parallel ranks, which alone split the batch; with ``sharding=\"hybrid\"`` or an int a 3-D mesh"
        " (replicate x shard x tensor parallel, shard groups of a multiple of ``k`` ranks). Either ``init=`` path"
        " works; docs/sharding.md says when it pays."
    ))
    tensor_plan: TensorPlanSelector | None = documented(None, (
        "With ``tensor_parallel > 1``: ``None`` finds each block's plan (attention input projections and the MLP's"
        " first linear column-wise, output projections row-wise, head counts per rank, norms replicated); else a"
        " dict of module-name patterns inside a block to ``torch.distributed.tensor.parallel`` styles, or a"
        " callable ``(block name, block) -> {module name: style}``. Each distinct block's plan is proven at setup"
        " against the unsplit block on a training step's input: one that fails, differs or (automatic plans)"
        " leaves the attention whole is refused, naming the block, the module and the fix."
    ))
    offload: OffloadMode | None = documented(None, (
        "``\"cpu\"`` keeps sharded parameters, gradients and optimizer state in host memory (FSDP2's"
        " ``CPUOffloadPolicy``; the optimizer steps on the CPU); on ``accelerator=\"cpu\"`` they already are, and it"
        " changes nothing."
    ))
    accumulation: AccumulationMode = documented("auto", (
        "With ``accumulate_grad_batches > 1``: ``\"auto\"`` keeps unsharded gradients across the micro-batches of an"
        " optimizer step (one reduce-scatter per step, as DDP's ``no_sync``) where they fit in memory, else"
        " ``\"sharded\"`` (a reduce-scatter per micro-batch, least memory); ``\"unsharded\"`` forces the first."
    ))
    prefetch: int | None = documented(None, (
        "How many units ahead each unit all-gathers explicitly (forward: the next blocks; backward: the previous"
        " ones), so the collective overlaps this unit's compute; ``0`` leaves FSDP2's implicit prefetch. ``None``:"
        " 1 on CPU ranks (whose gloo collectives are made asynchronous, ``sharding/cpu_overlap.py``), 0 on GPUs"
        " (FSDP2's streams)."
    ))
    blocks_per_unit: int | None = documented(None, (
        "Consecutive blocks per FSDP unit (in the order a step measured at setup calls them, else model order; the"
        " last unit may hold fewer). ``1`` is the recipe (least gathered"
        " memory); ``k > 1`` runs one all-gather, reduce-scatter and set of FSDP hooks per ``k`` blocks, with up to"
        " ``k`` blocks' parameters and gradients gathered at once. ``None``: as ``priority`` says: ``\"speed\"``, the"
        " planner's choice (up to every block in one unit) from the batch known at setup (``example_input_array``,"
        " else one batch of the train dataloader when fitting), else 1; ``\"memory\"``, 1."
    ))
    find_unused_parameters: SkippedBlocks = documented(False, (
        "``True`` for a model whose ranks may skip whole blocks in a training step (LayerDrop, blocks chosen per"
        " sample or per rank), as DDP's ``find_unused_parameters``: every block stays in the outer unit (a block one"
        " rank skips cannot simply be a unit: its collectives would pair with another block's), gathered for the"
        " step. ``\"units\"``: the blocks stay FSDP units (a model too large to gather whole), and a rank that skips"
        " one calls it as an identity where it would have run, so its unit's collectives pair with the other ranks'"
        " (``sharding/stand_ins.py``): for stacks whose blocks feed only the next one, called in the model's order"
        " (a ViT's; checked on 2 ranks); a model whose blocks also feed a shared path (DETR's decoder layers"
        " cross-attending to one memory) orders its backward differently by rank and hangs: keep ``True``. ``False``:"
        " a block holding"
        " trainable parameters that does not run in a training step's forward raises ``SkippedBlocksError`` before"
        " any gradient is sent, as DDP's default refuses it. Either way, on several ranks a parameter unused on a"
        " rank (an expert, a mask token) is reduced as a zero gradient. ``True`` also leaves a parameter no rank used"
        " without a gradient, as DDP's flag does (one small all-reduce per backward); ``False`` gives it a zero"
        " gradient, and setup's summary and a warning name the parameters the measured step's loss did not reach."
    ))

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        self._check_tensor_parallel()
        k, p = self.blocks_per_unit, self.prefetch
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise _invalid(self, "blocks_per_unit", "must be None or an int >= 1")
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0):
            raise _invalid(self, "prefetch", "must be None or an int >= 0")
        if self.accumulation not in ACCUMULATION_MODES:
            raise _invalid(self, "accumulation", f"is not supported. Choose one of: {ACCUMULATION_MODES}")
        if self.offload not in OFFLOAD_CHOICES:
            raise _invalid(self, "offload", f"is not supported. Choose one of: {OFFLOAD_CHOICES}")
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

    def _check_tensor_parallel(self) -> None:  # and find_unused_parameters, which it rules out
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"`tensor_parallel={tp!r}` must be an int >= 1: ranks that split each block.")
        plan = self.tensor_plan
        if plan is not None and not (callable(plan) or isinstance(plan, dict)):
            raise TypeError(
                f"`tensor_plan` must be None, a dict of module-name patterns to ParallelStyles, or a callable"
                f" (block name, block) -> {{name: style}}; got {type(plan).__name__}."
            )
        if not isinstance(self.find_unused_parameters, bool) and self.find_unused_parameters != STAND_INS:
            raise _invalid(self, "find_unused_parameters", f"must be True, False or {STAND_INS!r}")
        if self.find_unused_parameters is True:
            self._every_block_in_the_outer_unit()
        if self.find_unused_parameters and self.tensor_parallel > 1:
            raise _invalid(self, "find_unused_parameters", (
                "is not supported with tensor_parallel > 1: a skipped block's split matmuls would leave its tensor"
                " group's collectives unmatched. Pass tensor_parallel=1, or make every rank run every block"))

    def _every_block_in_the_outer_unit(self) -> None:
        """What ``find_unused_parameters=True`` means for the units, set here so that the planner, the traffic
        report and the summary all see it: every block in one unit that stays gathered (the outer unit's blocks)."""
        if self.blocks_per_unit not in (None, EVERY_BLOCK) or self.reshard_after_forward not in (None, False):
            raise ValueError(
                f"`find_unused_parameters=True` keeps every block in the outer unit, so `blocks_per_unit="
                f"{self.blocks_per_unit!r}` and `reshard_after_forward={self.reshard_after_forward!r}` cannot apply:"
                f" leave them unset, pass find_unused_parameters={STAND_INS!r} (the blocks stay units), or make every"
                " rank run every block and drop find_unused_parameters."
            )
        object.__setattr__(self, "blocks_per_unit", EVERY_BLOCK)  # frozen: set once, while being made
        object.__setattr__(self, "reshard_after_forward", False)

    @property
    def units_in_call_order(self) -> bool:
        """Whether units follow the order the step measured at setup calls the blocks (else model order): not where
        ranks may skip blocks, whose calls vary by rank and step (the stand-ins take the model's order)."""
        return not self.find_unused_parameters

    @property
    def stands_in(self) -> bool:
        """``find_unused_parameters="units"``: skipped blocks stay units, stood in for (``stand_ins.py``)."""
        return self.find_unused_parameters == STAND_INS

    def prefetch_on(self, device_type: str) -> int:
        """The user's prefetch, else 1 on CPU (no streams: only an explicit, asynchronous prefetch overlaps), else 0."""
        if self.prefetch is not None:
            return self.prefetch
        return 1 if device_type == "cpu" else 0


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
    """How many ranks shard one copy of the state: the one place that says what each layout means."""
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
class ParallelConfig:
    """What the user asked for (``strategy.config``), never changed by setup: what it means on the device is a
    :class:`~lightning_vitscale.sharding.ResolvedConfig` (``strategy.resolved``)."""

    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)
    checkpointing: CheckpointingPolicy = field(default_factory=CheckpointingPolicy)
    priority: Priority = documented("speed", (
        "What the settings left at ``None`` (``activation_checkpointing``, ``blocks_per_unit``,"
        " ``reshard_after_forward``) aim for. ``\"speed\"``: the plan with the least predicted step time whose"
        " predicted per-rank peak fits ``memory_budget`` (no checkpointing where the activations fit, selective"
        " before full, blocks grouped into units and kept gathered for backward as memory allows), planned from"
        " the batch (docs/memory.md); ``\"memory\"``: the recipe's memory-first plan (every block fully"
        " checkpointed, its own FSDP unit, resharded after forward). Settings you pass win over either."
    ))
    kernels: KernelMode | KernelPolicy = field(
        default_factory=KernelPolicy,
        metadata={
            "doc": (
                "``\"auto\"`` (CUDA: per-block ``torch.compile``, fused AdamW, and xformers attention where it is"
                " installed and measures faster; CPU: eager), ``\"eager\"``, or a :class:`KernelPolicy`."
            ),
            "default": "auto",  # the strategy's default; the field's own stands for "nothing resolved yet"
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.kernels, KernelPolicy) and self.kernels not in KERNEL_MODES:
            raise unknown_kernel_mode(self.kernels)
        by_priority(self)  # an unknown priority fails here, at construction


@dataclass(frozen=True)
class LeftToPriority:
    """What ``priority`` made of the settings left at ``None`` (``blocks_per_unit=None``: the planner's)."""

    checkpointing: CheckpointingPolicy
    blocks_per_unit: int | None
    planner_keeps: bool


def by_priority(config: ParallelConfig) -> LeftToPriority:
    """The one place ``priority`` is read: the settings the user left at ``None`` resolved by it; the ones set win."""
    sharding, checkpointing = config.sharding, config.checkpointing
    blocks: CheckpointSelector
    match config.priority:
        case "speed":
            blocks, per_unit, keeps = "auto", sharding.blocks_per_unit, sharding.reshard_after_forward is None
        case "memory":
            blocks, per_unit, keeps = True, sharding.blocks_per_unit or 1, False
        case other:
            raise ValueError(f"`priority={other!r}` is not supported. Choose one of: {PRIORITIES} (\"speed\": the"
                             " fastest plan that fits memory_budget; \"memory\": the recipe's memory-first plan).")
    if checkpointing.blocks is not None:
        blocks = checkpointing.blocks
    return LeftToPriority(dataclasses.replace(checkpointing, blocks=blocks), per_unit, keeps)


def unit_reshard(requested: bool | int | None, outer: bool) -> bool | int:
    """What ``reshard_after_forward`` one unit gets. ``None`` is the recipe: blocks free their gathered parameters
    after forward (one block's alive at a time), the outer unit keeps its own, which backward needs at once; an
    ``int`` (reshard to a smaller group) applies to the blocks only."""
    if requested is None:
        return not outer
    return bool(requested) if outer else requested
