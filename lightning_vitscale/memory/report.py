"""People-facing text for a memory plan: the per-rank breakdown table and the recommended settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_vitscale.memory_budget import MemoryBreakdown

if TYPE_CHECKING:
    from lightning_vitscale.planner import MemoryPlan

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


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def breakdown_table(columns: dict[str, MemoryBreakdown]) -> list[str]:
    """A Markdown table: one row per kind of memory, one column per named breakdown."""
    names = list(columns)
    lines = ["| per rank | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, label in _ROWS:
        lines.append(f"| {label} | " + " | ".join(gib(getattr(columns[n], key)) for n in names) + " |")
    lines.append("| **peak** | " + " | ".join(f"**{gib(columns[n].peak)}**" for n in names) + " |")
    lines.append("| at | " + " | ".join(columns[n].phase for n in names) + " |")
    return lines


def settings_line(plan: MemoryPlan) -> str:
    s = plan.chosen.settings
    parts = [f"activation_checkpointing: {len(s.checkpointed)} of {plan.num_blocks} blocks"]
    parts.append(f"reshard_after_forward={'True' if s.reshard_after_forward else 'False'}")
    if s.offload:
        parts.append("offload='cpu' (sharded state in host memory)")
    return ", ".join(parts)


def format_plan(plan: MemoryPlan) -> str:
    head = (
        f"Memory plan: {plan.num_params / 1e9:,.3f}B parameters, {plan.num_blocks} blocks, {plan.world_size} rank(s),"
        f" {plan.precision}, batch {plan.batch_size} per rank; budget {gib(plan.budget)} of {gib(plan.device_memory)}"
    )
    columns = {
        "chosen": plan.chosen.breakdown,
        "AC on every block": plan.all_checkpointed.breakdown,
        "AC off": plan.none_checkpointed.breakdown,
    }
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines = [head, "", *breakdown_table(columns), ""]
    lines.append(f"{verdict}: {gib(plan.chosen.breakdown.peak)} predicted peak per rank ({plan.reason})")
    lines.append(f"recommended: {settings_line(plan)}")
    how = "every block checkpointed" + (", state offloaded" if plan.chosen.settings.offload else "")
    lines.append(
        f"largest batch per rank that fits ({how}): {plan.max_batch}" if plan.max_batch
        else "no batch size fits on this many ranks: add ranks (devices/nodes)"
    )
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
