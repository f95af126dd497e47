"""The one device table (memory, FLOP/s, bandwidths, host speed: for the planner's rates, the MFU report and the
``plan`` CLI) and the step model's constants. Every row says where its numbers come from (``source``): the vendor's
datasheet (dense) or ``"measured: ..."``. Fields no datasheet gives (``reached_flops_per_s``, ``host_scale``) are
the measured H200's for every GPU until a run measures them; the CPU row is what a step reached on this
repository's 2-core CPU with gloo, not a peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from lightning_vitscale._utils import GIB

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Device:
    """One device's figures.

    ``name``: what ``plan --memory`` and ``plan_memory(device_memory=...)`` accept; ``match``: searched in
    ``torch.cuda.get_device_name()``, rows in table order (``"H100 PCIe"`` before ``"H100"``); ``memory_bytes``:
    ``None`` for the host's; ``bf16_flops_per_s``: dense peak, MFU's denominator (``None``: no trusted figure; V100's
    fp16); ``reached_flops_per_s``: what a step's matmuls and attention reach; ``link_bytes_per_s``: an all-gather's
    per rank inside a node; ``latency_s``: a unit all-gather's fixed cost; ``unit_s``: one FSDP unit's host cost per
    step; ``host_scale``: the machine's host seconds for one of this repository's CPU's (:data:`OP_HOST_S`).
    """

    name: str
    match: str | None
    memory_bytes: int | None
    bf16_flops_per_s: float | None
    reached_flops_per_s: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    latency_s: float
    unit_s: float
    source: str
    host_scale: float = 1.0


# The whole-step model's constants (:func:`~.step_cost.step_time`). Host work, measured on this repository's CPU by
# benchmarks/host_overhead.py (ViT-H's 32 blocks at width 64, 113 ops per block's forward as the planner counts
# them, Trainer.fit on one device, the code of GPU runs 3-4: results/cpu_2026-11-28_host_overhead_before.json) and,
# for the split of plain AMP O1's step between its blocks and the rest, the same model at depth 4, 12 and 32
# (7.6 ms + 3.0 ms per block on the loaded machine, 2026-12-01: the rest is 2.52 blocks' worth):
STEP_HOST_S = 49.06e-3 * 2.52 / 34.52
"""Host seconds per step beside the blocks: Lightning's loop, the outer layers, the loss."""
OP_HOST_S = 49.06e-3 / 34.52 / 113
"""Host seconds per op of a block's forward, its backward's and the optimizer's share included; a recomputed op
costs about the same (every block checkpointed added 45.4 ms for 32 x 119 recomputed ops, 11.9 us each)."""
UNIT_HOST_S = (94.58e-3 - 49.06e-3) / 33
"""Host seconds per FSDP unit per step: what ``VitScaleStrategy(activation_checkpointing=False)`` added over plain
AMP O1 for 33 units (hooks, copies, fp32 norms, DTensor optimizer, the guard)."""
FSDP_COPY_BYTES = 14
"""Bytes per parameter each all-gather or reduce-scatter moves through memory beside the wire (cast and copy in,
the collective's own copy, copy out). Stated, not fitted."""
# Fitted on the GPU rows of runs 3-4, each from the rows named (benchmarks/RESULTS.md, "throughput model"):
REACHED_SHARE = 431e12 / 989e12
"""The share of the dense bf16 peak a step's matmuls and attention reach; with :data:`ELEMENTWISE_PASSES`, from
single-device AMP O1's time per image (ViT-H/14, batch 32 to the largest) on the H200 (2.57 ms) and the H100
(2.70 ms), whose HBM differs (4.8 and 3.35 TB/s) and whose SMs do not: two equations, two unknowns. GPUs not
measured are assumed to reach the same share."""
ELEMENTWISE_PASSES = 2.0
"""Times the cheap ops' forward bytes move in a step (forward, and backward's read of the incoming gradient and
write of the outgoing): with :data:`REACHED_SHARE`, from the two GPUs' times per image."""
STEP_DEVICE_S = 16e-3
"""Device seconds per step beyond the FLOPs and the bytes (small kernels, the gaps between a step's thousands of
launches): single AMP O1's time at batch 32 beyond its per-image time, ViT-H/14 and ViT-B/16 alike."""
OVERLAP = 5.5
"""How the host's and the device's forward and backward overlap: ``(host^p + device^p)^(1/p)``, between their sum
(1) and their larger (infinity): nearly the larger, the host running ahead. VitScale eager at batch 32 and 64."""
TAIL_HOST_S = 3.5e-3
"""Host seconds (this repository's CPU's) after the step's sync before the device has work again: the optimizer's
launches, Lightning's loop. VitScale's rows at the largest batch against single AMP O1's."""
FUSED_SHARE = 0.78
"""The share of the cheap ops' bytes a compiled block does not move (Inductor fuses them into fewer kernels):
``kernels="auto"`` against ``"eager"`` at the largest batch, H200 and H100."""
COMPILED_BLOCK_HOST_S = 2.0e-3
"""Host seconds (this repository's CPU's) of one compiled block per step, forward and backward (guards, the graph's
launches) in place of its ops: ``kernels="auto"`` at batch 32 and 64, H200 and H100."""
H200_HOST_SCALE = 1.35
"""The H200 machine's host time against this repository's CPU for the same work, its kernel launches included
(VitScale eager at batch 32 and 64, run 3)."""


def _gpu(name: str, match: str, memory_gb: float, bf16: float | None, hbm: float, link: float,
         plan_peak: float | None = None) -> Device:
    """A datasheet row; ``plan_peak``: the peak the planner scales where MFU has no trusted one."""
    reached = REACHED_SHARE * (bf16 or plan_peak or 0.0)
    return Device(name=name, match=match, memory_bytes=int(memory_gb * GIB), bf16_flops_per_s=bf16,
                  reached_flops_per_s=reached, hbm_bytes_per_s=hbm, link_bytes_per_s=link,
                  latency_s=50e-6,  # an NVLink/PCIe collective's launch: an order of magnitude, not measured
                  unit_s=UNIT_HOST_S * H200_HOST_SCALE, host_scale=H200_HOST_SCALE,
                  source="datasheet (reached FLOP/s and the host: the H200's measured share and its machine's host)")


H200_MEASURED = ("measured: memory (139.8 GiB, torch), reached FLOP/s and its host (GPU runs 1-3) on one H200,"
                 " torch 2.11, 2026-11-27 (benchmarks/RESULTS.md; an 8192^3 bf16 matmul reached 784-791 TFLOP/s,"
                 " 79-80% of the dense peak); peaks, HBM and NVLink datasheet")

H100_HOST_SCALE = 1.9
"""The H100 machine's (run 4's host-bound ViT-H rows: its CPU side was slower and noisier than the H200's)."""
H100_MEASURED = ("measured: memory (79.2 GiB, torch), reached FLOP/s and its host (GPU run 4) on one H100 80GB"
                 " HBM3, torch 2.11, 2026-11-28 (benchmarks/RESULTS.md; an 8192^3 bf16 matmul reached 795 TFLOP/s);"
                 " peaks, HBM and NVLink datasheet")

# Links: NVLink per direction (SXM: 900 GB/s both ways), PCIe Gen4/5 x16 for PCIe cards.
DEVICES: tuple[Device, ...] = (
    _gpu("h100-pcie-80gb", r"H100 PCIe", 80, 756 * TB, 2.0 * TB, 64 * GB),
    _gpu("h100-nvl-94gb", r"H100 NVL", 94, 835 * TB, 3.9 * TB, 300 * GB),
    replace(_gpu("h100-80gb", r"H100", 79.2, 989 * TB, 3.35 * TB, 450 * GB),  # SXM
            unit_s=UNIT_HOST_S * H100_HOST_SCALE, source=H100_MEASURED, host_scale=H100_HOST_SCALE),
    replace(_gpu("h200-141gb", r"H200", 139.8, 989 * TB, 4.8 * TB, 450 * GB), source=H200_MEASURED),
    _gpu("a100-40gb", r"A100.*40GB", 40, 312 * TB, 1.555 * TB, 300 * GB),
    _gpu("a100-80gb", r"A100", 80, 312 * TB, 2.039 * TB, 300 * GB),
    _gpu("v100-32gb", r"V100", 32, 125 * TB, 0.9 * TB, 150 * GB),
    _gpu("l40s-48gb", r"L40S", 48, 362 * TB, 0.864 * TB, 32 * GB),
    _gpu("l40-48gb", r"L40", 48, 181 * TB, 0.864 * TB, 32 * GB),
    _gpu("l4-24gb", r"L4", 24, 121 * TB, 0.3 * TB, 32 * GB),
    # No trusted bf16 figure: MFU is not logged; the planner takes an A10's for its ratios.
    _gpu("a10g-24gb", r"A10G", 24, None, 0.6 * TB, 32 * GB, plan_peak=125 * TB),
    _gpu("a10-24gb", r"A10", 24, 125 * TB, 0.6 * TB, 32 * GB),
    Device(name="cpu", match=None, memory_bytes=None, bf16_flops_per_s=None,
           reached_flops_per_s=100e9, hbm_bytes_per_s=10e9, link_bytes_per_s=0.6e9, latency_s=2e-3, unit_s=3e-3,
           source="measured: one rank of the 2-core CPU with gloo (full recompute of the 6-block ViT ~55 ms for"
                  " ~5 GFLOP; gloo 0.5-0.75 GiB/s per rank; ~3 ms per unit with asynchronous collectives),"
                  " benchmarks/RESULTS.md 2026-11-26"),
)
DEFAULT_GPU = "h200-141gb"
"""The row for a GPU the table does not name, and for plans made for no device: the measured one."""

_BY_NAME = {device.name: device for device in DEVICES}


def device_named(name: str) -> Device:
    row = _BY_NAME.get(name.strip().lower())
    if row is None:
        raise ValueError(f"no device named {name!r} in the device table; named: {', '.join(_BY_NAME)}.")
    return row


def gpu_named(cuda_name: str) -> Device | None:
    """The first row whose ``match`` is in a ``torch.cuda.get_device_name()`` string, or ``None``."""
    return next((d for d in DEVICES if d.match is not None and re.search(d.match, cuda_name)), None)


def device_of(device: torch.device | str | None) -> Device | None:
    """The row of a torch device, or ``None`` (a GPU the table lacks, or no device)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return _BY_NAME["cpu"]
    if device.type == "cuda" and torch.cuda.is_available():
        return gpu_named(torch.cuda.get_device_name(device))
    return None


def memory_names() -> tuple[str, ...]:
    return tuple(d.name for d in DEVICES if d.memory_bytes is not None)
