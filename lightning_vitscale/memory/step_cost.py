"""What a memory-saving setting costs in step time: a block's recompute and a resharded block's second all-gather.

Plain roofline arithmetic on what :mod:`.op_costs` counted, so every number can be checked by hand:

- no checkpointing: nothing is repeated;
- ``"selective"``: the cheap ops run again, bounded by memory bandwidth: ``cheap_bytes / bytes_per_s``;
- ``"full"``: the whole forward runs again: ``flops / flops_per_s`` plus the cheap ops as above;
- resharding a unit after forward: its parameters are all-gathered again in backward: ``latency`` plus, unless
  the prefetched gather hides behind the later unit's backward (``regather_hidden``: GPU streams),
  ``gathered bytes x (world - 1) / world / link_bytes_per_s``; keeping it gathered costs nothing;
- tensor parallelism: each all-reduce of activations (:mod:`.tensor_split`) waits on the critical path:
  ``latency`` plus its ring bytes / ``link_bytes_per_s``; a checkpointed block's recompute runs its row-wise
  all-reduces again;
- each FSDP unit: ``unit_s`` per step for its hooks and the collectives the step's thread waits for
  (``blocks_per_unit``: fewer, larger units pay it fewer times); where collectives overlap compute (GPU streams;
  CPU ranks' asynchronous gloo collectives, ``sharding/cpu_overlap.py``), the first unit's all-gather and the
  last one's reduce-scatter (and, with replicas, all-reduce) have nothing to hide behind, so a larger unit exposes
  more bytes: what they send / ``link_bytes_per_s``.

The collectives and their bytes are the one model the setup summary's traffic report uses too
(:mod:`.collectives`: rings over their groups, dim 0 padded to the shard group, replicas for hybrid sharding).

A recompute never hides. The rates are :class:`DeviceRates`, read from the device table (:mod:`.devices`); only
their ratios steer the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_vitscale.memory.activations import BlockMemory
from lightning_vitscale.memory.collectives import ring_bytes, unit_collectives
from lightning_vitscale.memory.devices import DEFAULT_GPU, Device, device_named, device_of
from lightning_vitscale.memory.step_model import StepInputs, StepSettings, unit_spans


@dataclass(frozen=True)
class DeviceRates:
    """Throughputs a step's extra work runs at, per rank.

    Attributes:
        flops_per_s: what matmuls and attention reach in the compute dtype.
        bytes_per_s: memory bandwidth the cheap elementwise ops are bound by.
        link_bytes_per_s: per-rank bandwidth of an all-gather.
        latency_s: fixed cost of one unit's all-gather (launch, FSDP's hooks and copies).
        unit_s: fixed cost of one FSDP unit per step (its forward/backward hooks, the waits on its collectives).
        overlaps: whether collectives run beside compute (CUDA streams; gloo's worker threads once
            ``sharding/cpu_overlap.py`` issues them asynchronously, as setup does on CPU ranks).
        regather_hidden: whether a resharded unit's backward all-gather costs only its ``latency_s`` (a GPU's
            copy engines and NVLink run beside the SMs); on CPU ranks gloo's threads share the cores with compute.
    """

    flops_per_s: float
    bytes_per_s: float
    link_bytes_per_s: float
    latency_s: float
    unit_s: float
    overlaps: bool
    regather_hidden: bool


def rates_of(device: Device, accelerator: bool = True) -> DeviceRates:
    """The planner's rates from a row of the device table (:mod:`.devices`). ``accelerator``: a GPU, whose
    collectives overlap compute on their own streams and whose prefetched re-gather hides; CPU ranks overlap
    through gloo's threads (``sharding/cpu_overlap.py``), which share the cores with compute."""
    return DeviceRates(flops_per_s=device.reached_flops_per_s, bytes_per_s=device.hbm_bytes_per_s,
                       link_bytes_per_s=device.link_bytes_per_s, latency_s=device.latency_s, unit_s=device.unit_s,
                       overlaps=True, regather_hidden=accelerator)


GPU_RATES = rates_of(device_named(DEFAULT_GPU))
"""The rates of a GPU the table does not name, and of plans made for no device: the measured H200's row."""
CPU_RATES = rates_of(device_named("cpu"), accelerator=False)
"""One rank of the 2-core CPU with gloo (the table's ``"cpu"`` row: stated, not general)."""


def rates_for(device: torch.device | str | None) -> DeviceRates:
    """The rates for a device: its row of the device table (:func:`~.devices.device_of`); a GPU the table does
    not name, and ``None``, plan as :data:`GPU_RATES`, as the rest of the planner does."""
    row = device_of(device)
    if row is None:
        return GPU_RATES
    return rates_of(row, accelerator=row.match is not None)


def recompute_seconds(block: BlockMemory, mode: str | None, rates: DeviceRates, scale: float = 1.0) -> float:
    """Seconds per step that checkpointing ``block`` in ``mode`` (``None``, ``"selective"``, ``"full"``) adds."""
    if mode is None:
        return 0.0
    cheap = block.work.cheap_bytes * scale / rates.bytes_per_s
    return cheap if mode == "selective" else cheap + block.work.flops * scale / rates.flops_per_s


def tensor_parallel_seconds(inputs: StepInputs, modes: list[str | None], rates: DeviceRates) -> float:
    """Seconds per step of the tensor-parallel all-reduces (``inputs.tensor``; 0 without), block ``i``
    checkpointed in ``modes[i]`` (a recompute repeats its row-wise all-reduces): each on the critical path (the
    next op needs its result), ``latency_s`` plus what it sends / ``link_bytes_per_s``."""
    split = inputs.tensor
    if split is None:
        return 0.0
    calls = sum(b.calls for b in split.blocks)
    return calls * rates.latency_s + split.sent(modes, inputs.batch_scale) / rates.link_bytes_per_s


def regather_seconds(gathered_bytes: int, world: int, rates: DeviceRates) -> float:
    """Seconds per step that resharding a block of ``gathered_bytes`` after forward adds (a second all-gather:
    its fixed cost, and its bytes where nothing overlaps them)."""
    return _regather(ring_bytes(gathered_bytes, world), rates)


def _regather(sent: float, rates: DeviceRates) -> float:
    if rates.regather_hidden:  # prefetched during the later unit's backward
        return rates.latency_s
    return rates.latency_s + sent / rates.link_bytes_per_s


def units_and_regather_seconds(inputs: StepInputs, settings: StepSettings, rates: DeviceRates) -> float:
    """What the FSDP units of ``settings`` cost per step, from each unit's collectives (:mod:`.collectives`: padded,
    per group, replicas included): ``unit_s`` each, a second all-gather for each unit that reshards after forward
    (:func:`regather_seconds`) and, where collectives overlap compute, the largest unit's exposed all-gather,
    reduce-scatter and all-reduce (the first unit's gather and the last one's reduction have nothing to hide
    behind)."""
    spans = unit_spans(len(inputs.layout.blocks), settings.blocks_per_unit)
    seconds = exposed = 0.0
    for span in spans:
        collectives = unit_collectives(
            [shape for i in span for shape in inputs.layout.blocks[i]], shard=inputs.world, replicas=inputs.replicas,
            gather_itemsize=inputs.compute.itemsize, reduce_itemsize=inputs.reduce.itemsize,
            reshard=not settings.keeps(span[0]),
        )
        seconds += rates.unit_s
        seconds += sum(_regather(c.sent, rates) for c in collectives if c.kind == "regather")
        if rates.overlaps:
            sent = sum(c.sent for c in collectives if c.kind != "regather")
            exposed = max(exposed, sent / rates.link_bytes_per_s)
    return seconds + exposed


def block_modes(settings: StepSettings, n: int) -> list[str | None]:
    """Each block's checkpointing under ``settings``: ``"full"``, ``"selective"`` or ``None``."""
    return ["selective" if i in settings.selective else "full" if i in settings.checkpointed else None
            for i in range(n)]


def traffic_per_dimension(
    inputs: StepInputs, settings: StepSettings, outer_reshards: bool = False
) -> dict[str, float]:
    """Bytes one rank sends per step on each mesh dimension: ``"data_parallel"`` (FSDP's all-gathers and
    reduce-scatters of the block units and the outer unit, which stays gathered from forward to backward, hybrid
    sharding's all-reduces across replicas, the replicated fp32 norms' all-reduce) and, under tensor parallelism,
    ``"tensor_parallel"`` (the all-reduces of activations, :mod:`.tensor_split`). The same model of a unit's
    collectives as the setup summary's traffic report (:mod:`.collectives`). ``outer_reshards``: the outer unit
    reshards after forward too (``reshard_after_forward=True`` asked for every unit; the recipe keeps it)."""
    lay = inputs.layout
    spans = unit_spans(len(lay.blocks), settings.blocks_per_unit)
    units = [([s for i in span for s in lay.blocks[i]], not settings.keeps(span[0])) for span in spans]
    sent = 0.0
    for shapes, reshard in [*units, (lay.outer, outer_reshards)]:
        sent += sum(c.sent for c in unit_collectives(
            shapes, shard=inputs.world, replicas=inputs.replicas, gather_itemsize=inputs.compute.itemsize,
            reduce_itemsize=inputs.reduce.itemsize, reshard=reshard))
    norm_bytes = sum(math.prod(s) for s in lay.norms) * 4
    sent += ring_bytes(norm_bytes, inputs.world, reduce=True) + ring_bytes(norm_bytes, inputs.replicas, reduce=True)
    out = {"data_parallel": sent}
    if inputs.tensor is not None:
        out["tensor_parallel"] = inputs.tensor.sent(block_modes(settings, len(lay.blocks)), inputs.batch_scale)
    return out
