"""What a memory-saving setting costs in step time: a block's recompute and a resharded block's second all-gather.

Plain roofline arithmetic on what :mod:`.op_costs` counted, so every number can be checked by hand:

- no checkpointing: nothing is repeated;
- ``"selective"``: the cheap ops run again, bounded by memory bandwidth: ``cheap_bytes / bytes_per_s``;
- ``"full"``: the whole forward runs again: ``flops / flops_per_s`` plus the cheap ops as above;
- resharding a unit after forward: its parameters are all-gathered again in backward: ``latency`` plus, unless
  the prefetched gather hides behind the later unit's backward (``regather_hidden``: GPU streams),
  ``gathered bytes x (world - 1) / world / link_bytes_per_s``; keeping it gathered costs nothing;
- each FSDP unit: ``unit_s`` per step for its hooks and the collectives the step's thread waits for
  (``blocks_per_unit``: fewer, larger units pay it fewer times); where collectives overlap compute (GPU streams;
  CPU ranks' asynchronous gloo collectives, ``sharding/cpu_overlap.py``), the first unit's all-gather and the
  last one's reduce-scatter have nothing to hide behind, so a larger unit exposes more bytes:
  ``2 x unit bytes x (world - 1) / world / link_bytes_per_s``.

A recompute never hides. The rates are :class:`DeviceRates`; only their ratios steer the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_vitscale.memory.activations import BlockMemory
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


GPU_RATES = DeviceRates(flops_per_s=438e12, bytes_per_s=2e12, link_bytes_per_s=100e9, latency_s=50e-6,
                        unit_s=1.7e-3, overlaps=True, regather_hidden=True)
"""An H100/H200-class GPU in bf16. Measured on one H200 (torch 2.11, benchmarks/RESULTS.md, 2026-11-27):
``flops_per_s``, what ViT-H/14 training reached at its largest batch with ``kernels="auto"`` (44.3% of the
989 TFLOP/s dense bf16 peak; the same kernels run a recompute); ``unit_s``, the step time one FSDP unit added,
exposed, next to plain AMP O1 on the same GPU (ViT-H/14, batch 64, ``kernels="eager"``, one block per unit:
+55 ms over 33 units; FSDP2's per-unit hooks and copies, DTensor dispatch, and at that time the per-parameter
non-finite check). Datasheet orders of magnitude, not measured: ``bytes_per_s`` (HBM), ``link_bytes_per_s``
and ``latency_s`` (NVLink; one GPU has no link)."""

CPU_RATES = DeviceRates(flops_per_s=100e9, bytes_per_s=10e9, link_bytes_per_s=0.6e9, latency_s=2e-3, unit_s=3e-3,
                        overlaps=True, regather_hidden=False)
"""One rank of the 2-core CPU with gloo in benchmarks/RESULTS.md ("where a step's time goes", "fewer, larger FSDP
units", "CPU ranks overlap their collectives"): full recompute of the 6-block ViT ~55 ms for ~5 GFLOP; gloo moved
0.5-0.75 GiB/s per rank; with the collectives asynchronous, one block per unit (6 units) cost ~20 ms a step more
than 2 units of 3 blocks and one unit of all 6 ~20 ms more too (its gather and reduce-scatter exposed): ~3 ms
per unit (before the overlap each unit cost 8-9 ms: its collectives' waits); keeping the 6 blocks gathered for
backward saved 28 ms of a full-checkpointing step, about their bytes at the link rate: not hidden. Stated, not
general."""


def rates_for(device: torch.device | str | None) -> DeviceRates:
    """The rates for a device type; ``None`` plans for a GPU, as the rest of the planner does."""
    return CPU_RATES if device is not None and torch.device(device).type == "cpu" else GPU_RATES


def recompute_seconds(block: BlockMemory, mode: str | None, rates: DeviceRates, scale: float = 1.0) -> float:
    """Seconds per step that checkpointing ``block`` in ``mode`` (``None``, ``"selective"``, ``"full"``) adds."""
    if mode is None:
        return 0.0
    cheap = block.work.cheap_bytes * scale / rates.bytes_per_s
    return cheap if mode == "selective" else cheap + block.work.flops * scale / rates.flops_per_s


def regather_seconds(gathered_bytes: int, world: int, rates: DeviceRates) -> float:
    """Seconds per step that resharding a block of ``gathered_bytes`` after forward adds (a second all-gather:
    its fixed cost, and its bytes where nothing overlaps them)."""
    if rates.regather_hidden:  # prefetched during the later unit's backward
        return rates.latency_s
    return rates.latency_s + gathered_bytes * (world - 1) / world / rates.link_bytes_per_s


def units_seconds(unit_bytes: list[int], world: int, rates: DeviceRates) -> float:
    """Seconds per step that FSDP units of ``unit_bytes`` (gathered, in the compute dtype) cost by their number
    and, where collectives overlap compute, by the largest one's exposed all-gather and reduce-scatter."""
    exposed = 2 * max(unit_bytes, default=0) * (world - 1) / world / rates.link_bytes_per_s if rates.overlaps else 0.0
    return len(unit_bytes) * rates.unit_s + exposed


def units_and_regather_seconds(inputs: StepInputs, settings: StepSettings, rates: DeviceRates) -> float:
    """What the FSDP units of ``settings`` cost per step: their number (:func:`units_seconds`) and a second
    all-gather for each unit that reshards after forward (:func:`regather_seconds`)."""
    c, n = inputs.compute.itemsize, len(inputs.layout.blocks)
    spans = unit_spans(n, settings.blocks_per_unit)
    gathered = [sum(math.prod(s) for s in shapes) * c for shapes in inputs.layout.blocks]
    units = [sum(gathered[i] for i in span) for span in spans]
    regather = sum(regather_seconds(size, inputs.world, rates)
                   for size, span in zip(units, spans) if not settings.keeps(span[0]))
    return regather + units_seconds(units, inputs.world, rates)
