"""The memory planner's answer (:class:`MemoryPlan`) and how it reads: a per-rank breakdown table, the settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_vitscale._utils import human_bytes, mib
from lightning_vitscale.memory.plan_search import BlockPlan
from lightning_vitscale.memory.step_inputs import MemoryBreakdown, StepInputs, StepSettings


@dataclass(frozen=True)
class Candidate:
    settings: StepSettings
    breakdown: MemoryBreakdown


@dataclass
class MemoryPlan:
    """The planner's answer for one rank: ``summary()`` prints it.

    ``chosen``: the recommended settings and their breakdown, against both ends (``all_checkpointed``,
    ``none_checkpointed``); ``max_batch``: the largest per-rank batch that fits with every block checkpointed (0:
    none); both ``None`` where checkpointing was not measured (it fitted without, :func:`.plan_search.fits_unchecked`);
    ``extra_seconds``: the step time ``blocks`` adds (recompute, second all-gathers, per unit);
    ``tensor_parallel``: ranks splitting each block (``world_size`` counts them all, ``batch_size`` is one
    data-parallel rank's); ``traffic``: bytes one rank sends per step, per mesh dimension; ``inputs``: the measured
    step (the throughput model's input).
    """

    world_size: int
    precision: str
    batch_size: int
    budget: int
    device_memory: int
    num_blocks: int
    num_params: int
    chosen: Candidate
    all_checkpointed: Candidate | None
    none_checkpointed: Candidate
    fits: bool
    max_batch: int | None
    reason: str
    notes: list[str] = field(default_factory=list)
    blocks: BlockPlan = field(default_factory=BlockPlan)
    extra_seconds: float = 0.0
    tensor_parallel: int = 1
    traffic: dict[str, float] = field(default_factory=dict)
    inputs: StepInputs | None = field(default=None, repr=False, compare=False)

    @property
    def checkpointed(self) -> int:
        return len(self.chosen.settings.checkpointed)

    def summary(self) -> str:
        tp = self.tensor_parallel
        ranks = f"{self.world_size} rank(s)" if tp == 1 else (
            f"{self.world_size} ranks ({self.world_size // tp} data parallel x {tp} tensor parallel)")
        params = "parameters" if tp == 1 else "parameters per tensor-parallel rank"
        head = (f"Memory plan: {self.num_params / 1e9:,.3f}B {params}, {self.num_blocks} blocks, {ranks},"
                f" {self.precision}, batch {self.batch_size} per rank; budget {human_bytes(self.budget)} of"
                f" {human_bytes(self.device_memory)}")
        columns = {"chosen": self.chosen.breakdown, "AC off": self.none_checkpointed.breakdown}
        if self.all_checkpointed is not None:
            columns = {"chosen": self.chosen.breakdown, "AC on every block": self.all_checkpointed.breakdown,
                       "AC off": self.none_checkpointed.breakdown}
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [head, "", *breakdown_table(columns), ""]
        lines.append(f"{verdict}: {human_bytes(self.chosen.breakdown.peak)} predicted peak per rank ({self.reason})")
        offload = ", offload='cpu' (sharded state in host memory)" if self.chosen.settings.offload else ""
        lines.append(f"recommended: activation_checkpointing: {self.blocks.describe()}, predicted step time it adds"
                     f" {self.extra_seconds * 1e3:.1f} ms (recompute, all-gathers, per unit){offload}")
        how = "every block checkpointed" + (", state offloaded" if self.chosen.settings.offload else "")
        if self.max_batch is None:
            lines.append("checkpointing not measured: the step fits without it")
        else:
            lines.append(f"largest batch per rank that fits ({how}): {self.max_batch}" if self.max_batch
                         else "no batch size fits on this many ranks: add ranks (devices/nodes)")
        if self.traffic:
            lines.append("traffic per step (sent by one rank): " + ", ".join(
                f"{name.replace('_', ' ')} {mib(sent, 2)}" for name, sent in self.traffic.items()))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


_ROWS = (
    ("params", "parameters (sharded, master dtype)"),
    ("grads", "gradients (sharded)"),
    ("optimizer", "optimizer state (sharded)"),
    ("norms", "fp32 norms (replicated: params, grads, state)"),
    ("gathered", "gathered units in flight (compute dtype)"),
    ("activations", "activations kept for backward"),
    ("transient", "backward / optimizer temporaries"),
    ("batch", "input batch"),
)


def breakdown_table(columns: dict[str, MemoryBreakdown]) -> list[str]:
    """A Markdown table: one row per kind of memory, one column per named breakdown."""
    names = list(columns)
    lines = ["| per rank | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, label in _ROWS:
        lines.append(f"| {label} | " + " | ".join(human_bytes(getattr(columns[n], key)) for n in names) + " |")
    lines.append("| **peak** | " + " | ".join(f"**{human_bytes(columns[n].peak)}**" for n in names) + " |")
    lines.append("| at | " + " | ".join(columns[n].phase for n in names) + " |")
    return lines
