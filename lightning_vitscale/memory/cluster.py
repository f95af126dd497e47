"""What a named cluster is predicted to reach in images/s, DDP + AMP O1 against the recipe and the plan, by the
whole-step model (:func:`~.step_cost.step_time`): a prediction, within 15% of one H200's and one H100's measured
rows (``benchmarks/RESULTS.md``, "throughput model"); other GPUs are their datasheet rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_vitscale.memory.devices import Device
from lightning_vitscale.memory.memory_plan import MemoryPlan
from lightning_vitscale.memory.planner import largest_batch
from lightning_vitscale.memory.step_cost import DeviceRates, StepTime, compile_pays, rates_of, step_time
from lightning_vitscale.memory.step_inputs import StepInputs, StepSettings

DDP_EXTRA_BYTES = 6
"""Bytes per parameter plain AMP O1 under DDP holds beyond the recipe's unsharded state: DDP's gradient buckets (4)
and autocast's bf16 copy of the weights (2). One H200, run 3: DDP's peak 3.54 GiB (6.0 bytes per parameter) above
VitScale's at world size 1, whose activations per image matched AMP O1's (0.357 and 0.358 GiB, ViT-H/14)."""
BATCH_LIMIT = 4096


@dataclass(frozen=True)
class Forecast:
    setting: str
    batch: int
    ranks: int
    time: StepTime
    compiled: bool | None  # None: DDP + AMP O1 (eager)

    @property
    def images_per_second(self) -> float:
        return self.batch * self.ranks / self.time.seconds


def forecast(plan: MemoryPlan, device: Device) -> list[Forecast]:
    """DDP + AMP O1 at the planned batch and at its largest, the plan at the planned batch and the recipe's
    memory-first setting at its largest; ``kernels="auto"``'s choice per VitScale row."""
    if plan.inputs is None:
        raise ValueError("the plan holds no measured inputs (plan_memory's plans do)")
    inputs, batch, rates = plan.inputs, plan.batch_size, rates_of(device)
    replicated = dataclasses.replace(inputs, world=plan.world_size, replicas=1, tensor=None)  # DDP: every rank
    ddp_largest = min(BATCH_LIMIT, largest_batch(dataclasses.replace(replicated, world=1), plan.budget, batch,
                                                 settings=StepSettings(reshard_after_forward=False),
                                                 extra=DDP_EXTRA_BYTES * inputs.layout.num_params))
    out = [Forecast(f"DDP + AMP O1, {note}", b, plan.world_size, step_time(
        _scaled(replicated, b, batch), StepSettings(), rates, baseline="ddp"), None)
        for b, note in ((batch, "the planned batch"), (ddp_largest, "its largest batch")) if b]
    ranks = plan.world_size // plan.tensor_parallel
    out.append(_vitscale("VitScaleStrategy(), the plan above", _scaled(inputs, batch, batch), batch, ranks,
                         plan.chosen.settings, rates))
    if plan.max_batch:
        largest = min(BATCH_LIMIT, plan.max_batch)
        out.append(_vitscale("the recipe, memory-first (every block checkpointed), its largest batch",
                             _scaled(inputs, largest, batch), largest, ranks,
                             StepSettings(frozenset(range(plan.num_blocks))), rates))
    return out


def _scaled(inputs: StepInputs, batch: int, measured: int) -> StepInputs:
    return dataclasses.replace(inputs, batch_scale=inputs.batch_scale * batch / measured)


def _vitscale(setting: str, inputs: StepInputs, batch: int, ranks: int, settings: StepSettings,
              rates: DeviceRates) -> Forecast:
    compiled = compile_pays(inputs, settings, rates)[0]
    time = step_time(inputs, settings, rates, compiled=compiled, fused_optimizer=True)
    return Forecast(setting, batch, ranks, time, compiled)


def forecast_table(plan: MemoryPlan, device: Device) -> str:
    """The plan CLI's Markdown table of :func:`forecast`, marked as a prediction with the row's source."""
    rows = forecast(plan, device)
    ddp = next((r.images_per_second for r in rows if r.compiled is None and "largest" in r.setting), None)
    lines = [f"predicted throughput on {plan.world_size} x {device.name} (a PREDICTION of the planner's step model,"
             f" not a measurement; {device.name}: {device.source}):", "",
             "| setting | batch per GPU | images/s | vs DDP + AMP O1 at its largest batch | step | blocks |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ips = r.images_per_second
        versus = f"{ips / ddp:.2f}x" if ddp else "-"
        blocks = "eager (DDP)" if r.compiled is None else "compiled" if r.compiled else "eager"
        lines.append(f"| {r.setting} | {r.batch} | {ips:,.0f} | {versus} | {r.time.describe()} | {blocks} |")
    return "\n".join(lines)
