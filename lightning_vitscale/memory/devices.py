"""The one device table: each named device's memory, peak and reached FLOP/s, memory and link bandwidth and
FSDP's fixed cost per unit, read by the planner's rates (:mod:`.step_cost`), the MFU report
(``monitoring/throughput.py``) and the ``plan`` CLI's named memories.

Every row says where its numbers come from (``source``): ``"datasheet"`` (the vendor's figures; dense, no
sparsity) or ``"measured: <what, where, when>"`` for the fields a run replaced. Two fields no datasheet gives are
the same for every GPU until a GPU run measures them: ``reached_flops_per_s``, the share of the dense bf16 peak a
training step reaches (:data:`REACHED_SHARE`, measured on one H200), and ``unit_s``, what one FSDP unit adds to a
step (host-side hooks and copies, measured on the same H200). The CPU row is this repository's 2-core CPU with gloo:
every number in it is what a step reached there (``benchmarks/RESULTS.md``, "Step time"), not a peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from lightning_vitscale._utils import GIB

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Device:
    """One device's figures.

    Attributes:
        name: the key (``"h100-80gb"``): what ``python -m lightning_vitscale plan --memory`` and
            ``plan_memory(device_memory=...)`` accept.
        match: a regular expression searched in ``torch.cuda.get_device_name()`` (rows are tried in table order:
            ``"H100 PCIe"`` before ``"H100"``); ``None`` for the CPU row.
        memory_bytes: the device's memory (``None``: the host's, read at run time).
        bf16_flops_per_s: dense bf16 tensor-core peak, MFU's denominator (``None``: no trusted figure, MFU is not
            logged). V100 has no bf16: its fp16 figure.
        fp32_flops_per_s: dense fp32 peak (no TF32).
        reached_flops_per_s: what a training step's matmuls and attention reach in the compute dtype: the
            planner's recompute rate.
        hbm_bytes_per_s: memory bandwidth, what the cheap elementwise ops of a recompute are bound by.
        link_bytes_per_s: per-rank bandwidth of an all-gather inside a node (one direction).
        latency_s: the fixed cost of one unit's all-gather (launch, FSDP's hooks and copies).
        unit_s: the fixed cost of one FSDP unit per step (its hooks, the waits on its collectives).
        source: ``"datasheet"`` or ``"measured: ..."`` (which fields, on what, when).
    """

    name: str
    match: str | None
    memory_bytes: int | None
    bf16_flops_per_s: float | None
    fp32_flops_per_s: float | None
    reached_flops_per_s: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    latency_s: float
    unit_s: float
    source: str


REACHED_SHARE = 442e12 / 989e12
"""The share of the dense bf16 peak a training step reached on one H200 (ViT-H/14, ``kernels="auto"``, its largest
batch: 44.7%, benchmarks/RESULTS.md, GPU run 3, 2026-11-27); GPUs not measured are assumed to reach the same
share."""
GPU_UNIT_S = 0.66e-3
"""What one FSDP unit added to a step on that H200 (ViT-H/14, batch 32, ``kernels="eager"``, AC off: +21.7 ms over
33 units against plain AMP O1, GPU run 3, with the fused non-finite guard; at batch 64 the GPU hides half of it,
+9.9 ms). The batch-32 figure is taken because there the step is host-bound and the cost is fully exposed; it is
host-side, so it stands for every GPU until another is measured. (Run 1's 1.7 ms included the old guard's four
kernels per gradient.)"""
GPU_LATENCY_S = 50e-6  # an NVLink/PCIe collective's launch: an order of magnitude, not measured
DATASHEET = "datasheet (reached FLOP/s and unit_s: the H200's measured share and per-unit cost)"


def _gpu(name: str, match: str, memory_gb: float, bf16: float | None, fp32: float | None, hbm: float,
         link: float, plan_peak: float | None = None) -> Device:
    """A datasheet row; ``plan_peak``: the peak the planner scales where MFU has no trusted one."""
    reached = REACHED_SHARE * (bf16 or plan_peak or 0.0)
    return Device(name=name, match=match, memory_bytes=int(memory_gb * GIB), bf16_flops_per_s=bf16,
                  fp32_flops_per_s=fp32, reached_flops_per_s=reached, hbm_bytes_per_s=hbm, link_bytes_per_s=link,
                  latency_s=GPU_LATENCY_S, unit_s=GPU_UNIT_S, source=DATASHEET)


H200_MEASURED = ("measured: memory (139.8 GiB, torch), reached FLOP/s (442 TFLOP/s, ViT-H/14 kernels='auto') and"
                 " unit_s (0.66 ms) on one H200, torch 2.11, 2026-11-27 (benchmarks/RESULTS.md, GPU run 3; an 8192^3"
                 " bf16 matmul reached 784-791 TFLOP/s, 79-80% of the dense peak); peaks, HBM and NVLink datasheet")

H100_MEASURED = ("measured: memory (79.2 GiB, torch) and reached FLOP/s (411 TFLOP/s, 41.6% of the dense peak,"
                 " ViT-H/14 kernels='auto' at its largest batch) on one H100 80GB HBM3, torch 2.11, 2026-11-28"
                 " (benchmarks/RESULTS.md, GPU run 4; an 8192^3 bf16 matmul reached 795 TFLOP/s); unit_s the H200's"
                 " (that run's host-bound batch-32 steps were too noisy to read one); peaks, HBM and NVLink datasheet")

# Links: NVLink per direction (SXM: 900 GB/s both ways), PCIe Gen4/5 x16 for PCIe cards.
DEVICES: tuple[Device, ...] = (
    _gpu("h100-pcie-80gb", r"H100 PCIe", 80, 756 * TB, 51 * TB, 2.0 * TB, 64 * GB),
    _gpu("h100-nvl-94gb", r"H100 NVL", 94, 835 * TB, 60 * TB, 3.9 * TB, 300 * GB),
    Device(name="h100-80gb", match=r"H100", memory_bytes=int(79.2 * GIB), bf16_flops_per_s=989 * TB,  # SXM
           fp32_flops_per_s=67 * TB, reached_flops_per_s=411 * TB, hbm_bytes_per_s=3.35 * TB,
           link_bytes_per_s=450 * GB, latency_s=GPU_LATENCY_S, unit_s=GPU_UNIT_S, source=H100_MEASURED),
    Device(name="h200-141gb", match=r"H200", memory_bytes=int(139.8 * GIB), bf16_flops_per_s=989 * TB,
           fp32_flops_per_s=67 * TB, reached_flops_per_s=REACHED_SHARE * 989 * TB, hbm_bytes_per_s=4.8 * TB,
           link_bytes_per_s=450 * GB, latency_s=GPU_LATENCY_S, unit_s=GPU_UNIT_S, source=H200_MEASURED),
    _gpu("a100-40gb", r"A100.*40GB", 40, 312 * TB, 19.5 * TB, 1.555 * TB, 300 * GB),
    _gpu("a100-80gb", r"A100", 80, 312 * TB, 19.5 * TB, 2.039 * TB, 300 * GB),
    _gpu("v100-32gb", r"V100", 32, 125 * TB, 15.7 * TB, 0.9 * TB, 150 * GB),
    _gpu("l40s-48gb", r"L40S", 48, 362 * TB, 91.6 * TB, 0.864 * TB, 32 * GB),
    _gpu("l40-48gb", r"L40", 48, 181 * TB, 90.5 * TB, 0.864 * TB, 32 * GB),
    _gpu("l4-24gb", r"L4", 24, 121 * TB, 30.3 * TB, 0.3 * TB, 32 * GB),
    # No trusted bf16 figure: MFU is not logged; the planner takes an A10's for its ratios.
    _gpu("a10g-24gb", r"A10G", 24, None, None, 0.6 * TB, 32 * GB, plan_peak=125 * TB),
    _gpu("a10-24gb", r"A10", 24, 125 * TB, 31.2 * TB, 0.6 * TB, 32 * GB),
    Device(name="cpu", match=None, memory_bytes=None, bf16_flops_per_s=None, fp32_flops_per_s=None,
           reached_flops_per_s=100e9, hbm_bytes_per_s=10e9, link_bytes_per_s=0.6e9, latency_s=2e-3, unit_s=3e-3,
           source="measured: one rank of the 2-core CPU with gloo (full recompute of the 6-block ViT ~55 ms for"
                  " ~5 GFLOP; gloo 0.5-0.75 GiB/s per rank; ~3 ms per unit with asynchronous collectives),"
                  " benchmarks/RESULTS.md 2026-11-26"),
)
DEFAULT_GPU = "h200-141gb"
"""The row for a GPU the table does not name, and for plans made with no device (``plan_memory``): the measured
one."""

_BY_NAME = {device.name: device for device in DEVICES}


def device_named(name: str) -> Device:
    """The row keyed ``name`` (case-insensitive)."""
    row = _BY_NAME.get(name.strip().lower())
    if row is None:
        raise ValueError(f"no device named {name!r} in the device table; named: {', '.join(_BY_NAME)}.")
    return row


def gpu_named(cuda_name: str) -> Device | None:
    """The first row whose ``match`` is found in a ``torch.cuda.get_device_name()`` string, or ``None``."""
    return next((d for d in DEVICES if d.match is not None and re.search(d.match, cuda_name)), None)


def device_of(device: torch.device | str | None) -> Device | None:
    """The row of a torch device: the CPU row, the named GPU's, or ``None`` for a GPU the table lacks (and for
    ``None``)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return _BY_NAME["cpu"]
    if device.type == "cuda" and torch.cuda.is_available():
        return gpu_named(torch.cuda.get_device_name(device))
    return None


def memory_names() -> tuple[str, ...]:
    """The names with a memory size (every GPU row)."""
    return tuple(d.name for d in DEVICES if d.memory_bytes is not None)
