"""The setup summary (``strategy.plan``): what setup did to the model, as data for tests and tools and as text for
people. What the planner predicts is a :class:`~lightning_vitscale.MemoryPlan` (``memory/``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lightning_vitscale._utils import abbreviated, full_bytes, local_bytes, mib
from lightning_vitscale.kernels import describe_router
from lightning_vitscale.sharding.pipeline_facts import PipelineFacts
from lightning_vitscale.sharding.traffic import LayoutReport


@dataclass
class SetupSummary:
    """Facts about one parallelized model; ``VitScaleStrategy.plan`` after setup.

    Attributes (those whose name does not say it all):
        world_size: data-parallel ranks the model is sharded over.
        units: FSDP units (block units + the outer unit); ``units_choice``: why, where the planner chose.
        selective: the checkpointed blocks that recompute only their cheap ops.
        self_checkpointed: blocks that checkpoint themselves (e.g. HF gradient checkpointing): left alone.
        fp32_modules: modules kept in fp32 inside a low-precision model (normalization layers).
        layout: the sharding layout and bytes sent per step within and across nodes (``sharding/traffic.py``).
        memory: the predicted memory and, under ``activation_checkpointing="auto"``, the choice.
        init_peak_bytes: peak growth of this rank's host memory (sampled RSS) until every unit had its values.
        tensor_plans: block class -> its tensor-parallel plan, what it keeps whole and what its proof measured.
        tensor_interleaved: packed projections whose rows are held in per-rank order (their checkpoints too).
    """

    world_size: int
    blocks: dict[str, int]
    block_names: list[str]
    units: int
    checkpointed: list[str]
    self_checkpointed: list[str] = field(default_factory=list)
    selective: list[str] = field(default_factory=list)
    fp32_modules: list[str] = field(default_factory=list)
    num_params: int = 0
    param_bytes_full: int = 0
    param_bytes_local: int = 0
    precision: str = "32-true"
    notes: list[str] = field(default_factory=list)
    kernels: dict[str, str] = field(default_factory=dict)
    tensor_core_misses: list[str] = field(default_factory=list)
    layout: LayoutReport | None = None
    offload: str | None = None
    predicted_peak: int | None = None
    memory: str = ""
    accumulation: str = ""
    init_path: str = "built"
    init_peak_bytes: int = 0
    init_seconds: float = 0.0
    blocks_per_unit: int = 1
    units_choice: str = ""
    outer_blocks: int = 0
    """Blocks in the outer unit though several ranks shard it (tied weights, ``find_unused_parameters``)."""
    copies: bool = False
    """One rank: the outer unit's step computes on copies, not through FSDP2 (``sharding/compute_copies.py``)."""
    overlap: str = ""
    tensor_parallel: int = 1
    tensor_plans: dict[str, str] = field(default_factory=dict)
    tensor_interleaved: list[str] = field(default_factory=list)

    def summary(self) -> str:
        found = ", ".join(f"{name} x{count}" for name, count in self.blocks.items()) or "none (one outer unit)"
        share = self.param_bytes_local / self.param_bytes_full if self.param_bytes_full else 1.0
        lines = [
            f"VitScaleStrategy: {self._ranks()}, precision {self.precision}",
            f"  blocks found        : {found}",
            f"  FSDP units          : {self.units} ({self._block_units()}"
            + (")" if self.units == 1 and self.block_names else f" + 1 outer{self._outer_holds()})"),
            f"  checkpointed blocks : {len(self.checkpointed)} of {len(self.block_names)}"
            + (f", {len(self.selective)} selective (matmuls and attention kept)" if self.selective else "")
            + (f" ({self.memory})" if self.memory else ""),
            f"  parameters          : {self.num_params:,} ({mib(self.param_bytes_full)} unsharded,"
            f" {mib(self.param_bytes_local)} on this rank = {share:.2f}x)",
            f"  initial weights     : {_INIT_PATHS.get(self.init_path, self.init_path)}; peak host memory"
            f" +{mib(self.init_peak_bytes)} on this rank ({self.init_peak_bytes / max(self.param_bytes_full, 1):.2f}x"
            f" the model), {self.init_seconds:.1f} s",
        ]
        layout, hybrid = self.layout, self.layout.hybrid_traffic if self.layout is not None else None
        labelled = {  # printed where set, in this order
            "sharding": layout.sharding if layout is not None else "",
            "traffic per step": (layout.describe() if layout is not None else "") + (
                f"; sharding='hybrid' would send {mib(hybrid.inter_node, 2)} across nodes" if hybrid else ""),
            "offload": self.offload,
            "accumulation": self.accumulation,
            "tensor parallel": f"{self.tensor_parallel} ranks per block (mesh {self.world_size} data parallel x"
            f" {self.tensor_parallel} tensor parallel; the batch is split over the {self.world_size})"
            if self.tensor_parallel > 1 else "",
        }
        lines.extend(f"  {key:<20}: {value}" for key, value in labelled.items() if value)
        lines.extend(f"    {cls}: {plan}" for cls, plan in self.tensor_plans.items() if self.tensor_parallel > 1)
        labelled = {
            "collectives": self.overlap,
            "self-checkpointing": f"{len(self.self_checkpointed)} blocks (left as the model set them)"
            if self.self_checkpointed else "",
            "fp32 modules": f"{len(self.fp32_modules)} ({abbreviated(self.fp32_modules)})" if self.fp32_modules else "",
            **self.kernels,
            "tensor cores": f"{len(self.tensor_core_misses)} dims not multiples of 8"
            f" ({abbreviated(self.tensor_core_misses, 2)})" if self.tensor_core_misses else "",
        }
        lines.extend(f"  {key:<20}: {value}" for key, value in labelled.items() if value)
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def _ranks(self) -> str:
        if self.tensor_parallel == 1:
            return f"{self.world_size} rank(s)"
        tp = self.tensor_parallel
        return f"{self.world_size * tp} ranks ({self.world_size} data parallel x {tp} tensor parallel)"

    def _block_units(self) -> str:
        chosen = f" ({self.units_choice})" if self.units_choice else ""
        copies = "; no FSDP2 per-parameter work: the step computes on copies made in one foreach copy" * self.copies
        if self.units == 1 and self.outer_blocks:
            return f"the outer unit, with the {len(self.block_names)} blocks{chosen}"
        if self.units == 1 and self.block_names:
            blocks = f"the outer unit, with the {len(self.block_names)} blocks"
            return f"{blocks}: one rank, all kept gathered{chosen}{copies}"
        if self.units == 1 and self.copies:
            return f"the outer unit, no blocks{copies}"
        in_units = len(self.block_names) - self.outer_blocks
        blocks = f"{in_units} of the {len(self.block_names)} blocks" if self.outer_blocks else f"{in_units} blocks"
        if self.blocks_per_unit > 1:
            return f"{blocks}, up to {self.blocks_per_unit} per unit{chosen}"
        joined = f" in {self.units - 1} units" if self.units - 1 != in_units else ""
        return f"{blocks}{joined}{chosen}"

    def _outer_holds(self) -> str:
        return f" with the other {self.outer_blocks}" if self.outer_blocks else ""


def summary_from_facts(facts: PipelineFacts) -> SetupSummary:
    """The setup summary from what the pipeline's steps did (the later setup steps add layout, memory, ...)."""
    checkpointed = facts.checkpointing.modes
    return SetupSummary(
        world_size=facts.world_size,
        blocks=facts.described,
        block_names=facts.blocks,
        units=len(facts.units.all),
        copies=facts.units.copies,
        outer_blocks=facts.units.tied + facts.units.skippable + facts.units.alone,
        blocks_per_unit=facts.units.blocks_per_unit,
        checkpointed=list(checkpointed),
        selective=[name for name, mode in checkpointed.items() if mode == "selective"],
        self_checkpointed=facts.checkpointing.self_checkpointed,
        fp32_modules=[name for name, _ in facts.norms.modules],
        num_params=sum(p.numel() for p in facts.params),
        param_bytes_full=full_bytes(facts.params),
        param_bytes_local=local_bytes(facts.params),
        precision=facts.precision,
        notes=_notes(facts),
        kernels=_kernel_lines(facts),
        tensor_core_misses=facts.tensor_core_misses,
        init_path=facts.init.path,
        init_peak_bytes=facts.init.peak_bytes,
        init_seconds=facts.init.seconds,
        overlap=facts.overlap,
        tensor_parallel=facts.tensor.size if facts.tensor else 1,
        tensor_plans=facts.tensor.plans if facts.tensor else {},
        tensor_interleaved=facts.tensor.interleaved if facts.tensor else [],
    )


def _kernel_lines(facts: PipelineFacts) -> dict[str, str]:
    counts = Counter(facts.compiled.block_classes)
    compiled = ", ".join(f"{name} x{count}" for name, count in counts.items()) or "off"
    lines = {
        "compiled blocks": compiled + (f" ({facts.kernels.reason})" if facts.kernels.reason else ""),
        "attention": describe_router(facts.router),
        "fused optimizer": "on" if facts.kernels.fused_optimizer else "off",
    }
    if facts.compiled.outer is not None:
        lines["compiled outer"] = ", ".join(facts.compiled.outer) or "nothing outside the blocks"
    return lines


def reused_blocks_fix(reused: list[tuple[str, str, int]]) -> str:
    """What to do about a block every layer reuses: name its class, so it becomes a unit checkpointed per call."""
    named = ", ".join(f"{name} ({cls}) runs {times} times per step" for name, cls, times in reused)
    classes = ", ".join(sorted({cls for _, cls, _ in reused}))
    return (f"{named}: if it is a block whose weights its layers share, pass blocks={{{classes}}} to make it a unit"
            " of its own, checkpointed at each call where activation checkpointing is on")


def _notes(facts: PipelineFacts) -> list[str]:
    notes = [] if facts.blocks else [f"no repeated blocks in {facts.model_class}: one outer FSDP unit only"
                                     + (f"; {reused_blocks_fix(facts.reused)}" if facts.reused else "")]
    if facts.joined:
        kinds = sorted({", ".join(classes) for classes in facts.joined.values()})
        notes.append(f"{len(facts.joined)} repeated containers are never called themselves (their parent calls what"
                     f" they hold): each is one FSDP unit over the modules of it that run ({'; '.join(kinds)}),"
                     " each module a block of its own for checkpointing")
    if facts.units.tied:
        notes.append(f"{facts.units.tied} block(s) share a weight with another unit or the rest of the model (tied):"
                     " left in the outer unit, which manages every use of it (FSDP2 lets one unit manage a weight)")
    if facts.units.skippable:
        notes.append(f"find_unused_parameters=True: the {facts.units.skippable} blocks stay in the outer unit (a block"
                     " some ranks skip cannot simply be a unit; find_unused_parameters=\"units\" keeps them units)")
    if facts.units.alone:
        notes.append(f"find_unused_parameters=\"units\": {facts.units.alone} block(s) in the outer unit, each held"
                     " alone (no stack of blocks to stand a skipped one in by)")
    if facts.made_contiguous:
        notes.append(f"{len(facts.made_contiguous)} channels_last parameter(s) made contiguous for FSDP"
                     f" ({abbreviated(facts.made_contiguous)}): same values; convolutions run channels_last when their"
                     " inputs are (x.to(memory_format=torch.channels_last))")
    scalars = facts.norms.scalars
    if scalars:
        notes.append(f"{len(scalars)} 0-dim or complex parameter(s) ({abbreviated(scalars)}), which FSDP2 cannot shard:"
                     " replicated"
                     " outside the units in their own dtype, gradients averaged with one all-reduce per step")
    if facts.init.not_reproduced:
        notes.append(f"{len(facts.init.not_reproduced)} meta tensor(s) whose init could not be reproduced (warned)")
    return notes


_INIT_PATHS = {
    "exact": "exact (rank 0 ran configure_model, shards scattered unit by unit)",
    "meta": "meta (built on meta, the model's own init replayed on each shard)",
    "built": "built before setup (rank 0's values scattered unit by unit)",
}

