"""What a setting costs in step time, by roofline arithmetic on what :mod:`.op_costs` counted (checkable by hand):

- ``"selective"`` checkpointing reruns the cheap ops (``cheap_bytes / bytes_per_s``), ``"full"`` the forward too
  (``+ flops / flops_per_s``); a recompute never hides;
- a resharded unit is all-gathered again in backward: ``latency`` plus, unless the prefetch hides it (GPU
  streams), its bytes / ``link_bytes_per_s`` (:mod:`.collectives`' model);
- tensor parallelism's all-reduces wait on the critical path, a recompute repeats the row-wise ones;
- each FSDP unit costs ``unit_s``; where collectives overlap compute, the first gather and the last reduction have
  nothing to hide behind: a larger unit exposes more.

The whole step (:func:`step_time`): the device's work (FLOPs, the cheap ops' bytes, recompute, FSDP's copies,
exposed collectives) and the host's (each op, each unit, or one call per compiled block) overlap until the step's
one sync (the non-finite guard), so forward and backward take about the larger (:data:`OVERLAP`), then the
optimizer and the loop follow; AMP O1 and DDP (``baseline``) never sync. Host constants are this repository's CPU's
scaled by each GPU machine's ``host_scale`` (``benchmarks/RESULTS.md``, "throughput model").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_vitscale.memory.activations import BlockMemory
from lightning_vitscale.memory.collectives import Collective, ring_bytes, unit_collectives
from lightning_vitscale.memory.devices import (
    COMPILED_BLOCK_HOST_S,
    DEFAULT_GPU,
    ELEMENTWISE_PASSES,
    FSDP_COPY_BYTES,
    FUSED_SHARE,
    OP_HOST_S,
    OVERLAP,
    STEP_DEVICE_S,
    STEP_HOST_S,
    TAIL_HOST_S,
    Device,
    device_named,
    device_of,
)
from lightning_vitscale.memory.step_inputs import OPTIMIZER_STATES, StepInputs, StepSettings, unit_spans


@dataclass(frozen=True)
class DeviceRates:
    """Throughputs a step's work runs at, per rank (fields as :class:`~.devices.Device`'s).

    ``overlaps``: collectives run beside compute (CUDA streams; gloo's threads, ``sharding/cpu_overlap.py``);
    ``regather_hidden``: a resharded unit's backward all-gather costs only ``latency_s`` (GPU copy engines; on CPU
    gloo's threads share the cores); ``overlap``: host and device work's (:data:`OVERLAP` on a GPU, none on CPU).
    """

    flops_per_s: float
    bytes_per_s: float
    link_bytes_per_s: float
    latency_s: float
    unit_s: float
    overlaps: bool
    regather_hidden: bool
    host_scale: float = 1.0
    overlap: float = 1.0


def rates_of(device: Device, accelerator: bool = True) -> DeviceRates:
    """The planner's rates from a row of the device table; ``accelerator``: a GPU (its prefetched re-gather hides)."""
    return DeviceRates(flops_per_s=device.reached_flops_per_s, bytes_per_s=device.hbm_bytes_per_s,
                       link_bytes_per_s=device.link_bytes_per_s, latency_s=device.latency_s, unit_s=device.unit_s,
                       overlaps=True, regather_hidden=accelerator, host_scale=device.host_scale,
                       overlap=OVERLAP if accelerator else 1.0)


GPU_RATES = rates_of(device_named(DEFAULT_GPU))
"""A GPU the table does not name, and plans made for no device: the measured H200's row."""


def rates_for(device: torch.device | str | None) -> DeviceRates:
    row = device_of(device)
    if row is None:
        return GPU_RATES
    return rates_of(row, accelerator=row.match is not None)


def recompute_seconds(
    block: BlockMemory, mode: str | None, rates: DeviceRates, scale: float = 1.0, fused: float = 0.0
) -> float:
    """Device seconds per step that checkpointing ``block`` in ``mode`` adds; ``fused``: the share of the cheap ops'
    bytes a compiled block does not move (:data:`FUSED_SHARE`)."""
    if mode is None:
        return 0.0
    work = block.work if mode == "selective" else block.work.repeated
    cheap = work.cheap_bytes * (1.0 - fused) * scale / rates.bytes_per_s
    return cheap if mode == "selective" else cheap + work.flops * scale / rates.flops_per_s


def tensor_parallel_seconds(inputs: StepInputs, modes: list[str | None], rates: DeviceRates) -> float:
    """Seconds per step of the tensor-parallel all-reduces (0 without), block ``i`` checkpointed in ``modes[i]``."""
    split = inputs.tensor
    if split is None:
        return 0.0
    calls = sum(b.calls for b in split.blocks)
    return calls * rates.latency_s + split.sent(modes, inputs.batch_scale) / rates.link_bytes_per_s


def regather_seconds(sent: float, rates: DeviceRates) -> float:
    """A second all-gather's seconds (of ``sent`` bytes per rank): its fixed cost, and its bytes where not hidden."""
    if rates.regather_hidden:  # prefetched during the later unit's backward
        return rates.latency_s
    return rates.latency_s + sent / rates.link_bytes_per_s


def units_and_regather_seconds(inputs: StepInputs, settings: StepSettings, rates: DeviceRates) -> float:
    """The FSDP units' cost per step: ``unit_s`` each, regathers, exposed collectives (see the module docstring)."""
    seconds = exposed = 0.0
    for collectives in _collectives(inputs, _block_units(inputs, settings)):
        seconds += rates.unit_s
        seconds += sum(regather_seconds(c.sent, rates) for c in collectives if c.kind == "regather")
        if rates.overlaps:
            sent = sum(c.sent for c in collectives if c.kind != "regather")
            exposed = max(exposed, sent / rates.link_bytes_per_s)
    return seconds + exposed


_Unit = tuple[list[tuple[int, ...]], bool, bool]  # parameter shapes, resharded after forward, reduced at this call


def _block_units(inputs: StepInputs, settings: StepSettings) -> list[_Unit]:
    """Each block unit's parameter shapes, whether it reshards after forward and whether it reduces, once per call
    of it a step makes: FSDP2 gathers and regathers a unit whose block every layer shares (or a backbone run on each
    crop size) at each of its calls, and reduce-scatters it once (``sharding/deferred_reduction.py``)."""
    spans = unit_spans(inputs, settings)
    return [([s for i in span for s in inputs.layout.blocks[i]], not settings.keeps(span[0]), call == 0)
            for span in spans for call in range(unit_calls(inputs, span))]


def unit_calls(inputs: StepInputs, span: range | list[int]) -> int:
    """How many times a step runs the unit of the blocks in ``span`` (1 but for a block every layer shares)."""
    return max((inputs.profile.blocks[i].calls for i in span), default=1)


def _collectives(inputs: StepInputs, units: list[_Unit]) -> list[list[Collective]]:
    gathers = ("all_gather", "regather")
    return [[c for c in unit_collectives(shapes, shard=inputs.world, replicas=inputs.replicas, reshard=reshard,
                                         gather_itemsize=inputs.compute.itemsize,
                                         reduce_itemsize=inputs.reduce.itemsize) if reduced or c.kind in gathers]
            for shapes, reshard, reduced in units]


def block_modes(settings: StepSettings, n: int) -> list[str | None]:
    return ["selective" if i in settings.selective else "full" if i in settings.checkpointed else None
            for i in range(n)]


def traffic_per_dimension(
    inputs: StepInputs, settings: StepSettings, outer_reshards: bool = False
) -> dict[str, float]:
    """Bytes one rank sends per step on each mesh dimension: ``"data_parallel"`` (the units' collectives, the fp32
    norms' all-reduce) and, under tensor parallelism, ``"tensor_parallel"``. ``outer_reshards``: the outer unit
    reshards after forward too (``reshard_after_forward=True``; the recipe keeps it gathered)."""
    lay = inputs.layout
    units = [*_block_units(inputs, settings), (lay.outer, outer_reshards, True)]
    sent = 0.0
    for collectives in _collectives(inputs, units):  # unit by unit: the same float sums as the summary's report
        sent += sum(c.sent for c in collectives)
    norm_bytes = sum(math.prod(s) for s in lay.norms) * 4
    sent += ring_bytes(norm_bytes, inputs.world, reduce=True) + ring_bytes(norm_bytes, inputs.replicas, reduce=True)
    out = {"data_parallel": sent}
    if inputs.tensor is not None:
        out["tensor_parallel"] = inputs.tensor.sent(block_modes(settings, len(lay.blocks)), inputs.batch_scale)
    return out


Baseline = Literal["single", "ddp"]
"""Plain single-device AMP O1 (``strategy="auto"``) and DDP + AMP O1, for comparison."""


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds: the host issuing forward and backward, the device running them, and after the
    step's sync (``tail_s``, nothing hidden) the loop and the optimizer."""

    host_s: float
    device_s: float
    tail_s: float
    overlap: float

    @property
    def seconds(self) -> float:
        return (self.host_s**self.overlap + self.device_s**self.overlap) ** (1.0 / self.overlap) + self.tail_s

    @property
    def host_bound(self) -> bool:
        return self.host_s > self.device_s

    def describe(self) -> str:
        bound = "host-bound" if self.host_bound else "device-bound"
        return (f"{self.seconds * 1e3:.0f} ms per step ({bound}: host {self.host_s * 1e3:.0f} ms, device"
                f" {self.device_s * 1e3:.0f} ms, then {self.tail_s * 1e3:.0f} ms after the step's sync)")


def step_time(
    inputs: StepInputs, settings: StepSettings, rates: DeviceRates, *, compiled: bool = False,
    fused_optimizer: bool | None = None, baseline: Baseline | None = None, synced: bool | None = None,
) -> StepTime:
    """One step's time under ``settings`` (``compiled``: every block; ``fused_optimizer``: by default with
    ``compiled``, as ``kernels="auto"`` sets both), or a :data:`Baseline`'s (``settings`` ignored). ``synced``: the
    non-finite guard reads its decision on the host before the optimizer step, so the loop's host work and the
    optimizer wait for a drained queue; by default only without a fused optimizer, whose step takes the decision
    on the device (``precision/nonfinite.py``; runs 1-5 measured the guard synced with every optimizer)."""
    fused_optimizer = compiled if fused_optimizer is None else fused_optimizer
    synced = not fused_optimizer if synced is None else synced
    n = len(inputs.profile.blocks)
    modes: list[str | None] = [None] * n if baseline else block_modes(settings, n)
    fused = FUSED_SHARE if compiled else 0.0
    host = device = 0.0
    for block, mode in zip(inputs.profile.blocks, modes):
        work = block.work
        device += inputs.batch_scale * (3 * work.flops / rates.flops_per_s
                                        + ELEMENTWISE_PASSES * work.cheap_bytes * (1.0 - fused) / rates.bytes_per_s)
        device += recompute_seconds(block, mode, rates, inputs.batch_scale, fused)
        again = {None: 0, "selective": work.cheap_ops, "full": work.repeated.ops}[mode]  # an eager recompute's ops
        host += COMPILED_BLOCK_HOST_S if compiled else (work.ops + again) * OP_HOST_S
    host = (host + STEP_HOST_S) * rates.host_scale
    device += STEP_DEVICE_S if rates.overlap > 1 else 0.0
    params = inputs.layout.num_params
    if baseline is not None:  # AMP O1 casts the weights each forward and the gradients back: 14 bytes a parameter
        copies = params * (14 + (16 if baseline == "ddp" else 0))  # DDP: gradients into its buckets and back
        device += (copies + _optimizer_bytes(inputs, params, fused=False)) / rates.bytes_per_s
        device += _ddp_exposed(inputs, params, device, rates) if baseline == "ddp" else 0.0
        return StepTime(host, device, 0.0, rates.overlap)
    spans = unit_spans(inputs, settings)
    # Per unit: hooks on the host; copies in and out of each all-gather and reduce-scatter through memory; the
    # regathers' launches and the collectives nothing hides (the first gather, the last reduction, and all of
    # them once they outlast the compute beside them).
    host += (len(spans) + 1) * rates.unit_s
    sizes = [sum(math.prod(s) for i in span for s in inputs.layout.blocks[i]) for span in spans]
    copied = sum(size * (3 - settings.keeps(span[0])) * unit_calls(inputs, span) for size, span in zip(sizes, spans))
    device += (copied + 2 * sum(math.prod(s) for s in inputs.layout.outer)) * FSDP_COPY_BYTES / rates.bytes_per_s
    device += units_and_regather_seconds(inputs, settings, rates) - len(spans) * rates.unit_s
    device += tensor_parallel_seconds(inputs, modes, rates)
    device += max(0.0, traffic_per_dimension(inputs, settings)["data_parallel"] / rates.link_bytes_per_s - device)
    optimizer = _optimizer_bytes(inputs, params / inputs.world, fused=fused_optimizer) / rates.bytes_per_s
    if not synced and rates.overlap > 1:  # nothing drains the queue: the tail overlaps as AMP O1's does
        return StepTime(host + TAIL_HOST_S * rates.host_scale, device + optimizer, 0.0, rates.overlap)
    return StepTime(host, device, TAIL_HOST_S * rates.host_scale + optimizer, rates.overlap)


def compile_pays(inputs: StepInputs, settings: StepSettings, rates: DeviceRates) -> tuple[bool, str]:
    """Whether compiling every block makes the step faster (``kernels="auto"``'s rule): compiled blocks move fewer
    bytes but cost the host more, so they pay where the step is device-bound; and why, for the setup summary."""
    eager = step_time(inputs, settings, rates, fused_optimizer=True)
    compiled = step_time(inputs, settings, rates, compiled=True)
    pays = compiled.seconds < eager.seconds

    def said(time: StepTime) -> str:
        return f"{time.seconds * 1e3:.0f} ms ({'host' if time.host_bound else 'device'}-bound)"

    return pays, (f"{'compiled' if pays else 'eager'} at this batch: predicted step {said(compiled)} compiled against"
                  f" {said(eager)} eager")


def _optimizer_bytes(inputs: StepInputs, params: float, fused: bool) -> float:
    """Bytes one optimizer step moves: parameter, gradient and states read, parameter and states written, once fused;
    a foreach step about three times (AdamW: 82 bytes a parameter, counted)."""
    states = OPTIMIZER_STATES[inputs.optimizer]
    return (3 + 2 * states) * inputs.master.itemsize * params * (1 if fused else 3)


def _ddp_exposed(inputs: StepInputs, params: int, device: float, rates: DeviceRates) -> float:
    """DDP's gradient all-reduce, hidden behind backward (two thirds of the compute) but for its last 25 MiB bucket."""
    ranks = inputs.world * inputs.replicas
    if ranks < 2:
        return 0.0
    sent = ring_bytes(params * inputs.reduce.itemsize, ranks, reduce=True) / rates.link_bytes_per_s
    last = ring_bytes(25 * 2**20, ranks, reduce=True) / rates.link_bytes_per_s + rates.latency_s
    return max(last, sent - 2 * device / 3)
