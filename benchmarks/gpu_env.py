"""The facts a GPU measurement needs beside it: device, driver, versions, and what a bf16 matmul reaches here.

Usage::

    python benchmarks/gpu_env.py --out env.json            # on the GPU
    python benchmarks/gpu_env.py --out env.json --dry-run  # on CPU: a small fp32 matmul, no nvidia-smi

The matmul probe (an ``n x n x n`` product, ``--repeats`` timed with CUDA events after 3 warm-ups, random data)
is the ceiling the table's MFU can be read against: the datasheet's dense bf16 peak is what MFU divides by.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/gpu_env.py` puts benchmarks/, not the repo root, on the path
    sys.path.insert(0, str(ROOT))

PACKAGES = ("torch", "torchvision", "lightning", "pytorch-lightning", "torchmetrics", "timm", "transformers", "triton",
            "xformers", "numpy")
SMI_FIELDS = ("name", "driver_version", "memory.total", "power.limit", "clocks.max.sm", "clocks.max.memory",
              "pcie.link.gen.current", "compute_cap")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["cuda (torch built with)"] = torch.version.cuda
    found["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return found


def nvidia_smi() -> dict[str, str] | str:
    """The fields above as nvidia-smi reports them, or why there are none."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    query = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"nvidia-smi failed ({done.returncode}): {done.stderr.strip()[:200]}"
    values = [v.strip() for v in done.stdout.splitlines()[0].split(",")]
    return dict(zip(SMI_FIELDS, values))


def matmul_probe(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """TFLOP/s of ``n x n x n`` products: CUDA events around ``repeats`` products (host clock on CPU)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = time.perf_counter() - t0
    return dict(n=n, dtype=str(dtype).removeprefix("torch."), repeats=repeats, seconds=seconds,
                tflops=2 * n**3 * repeats / seconds / 1e12)


def collect(dry_run: bool, n: int, repeats: int) -> dict[str, Any]:
    from lightning_vitscale.monitoring.throughput import device_peak_flops

    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda" if cuda else "cpu")
    facts: dict[str, Any] = dict(host=platform.node(), platform=platform.platform(), cpus=os.cpu_count(),
                                 versions=versions(), nvidia_smi=nvidia_smi() if cuda else "dry run: not asked")
    if cuda:
        props = torch.cuda.get_device_properties(device)
        facts["device"] = dict(name=props.name, capability=f"{props.major}.{props.minor}",
                               multiprocessors=props.multi_processor_count, memory_gib=props.total_memory / 2**30)
        peak = device_peak_flops(device)
        facts["datasheet_dense_bf16_tflops"] = peak / 1e12 if peak else None
        facts["matmul"] = matmul_probe(device, n, torch.bfloat16, repeats)
    else:
        facts["device"] = dict(name="CPU" + (" (dry run)" if dry_run else ""))
        facts["matmul"] = matmul_probe(device, min(n, 512), torch.float32, min(repeats, 3))
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU: a 512 x 512 fp32 probe, no nvidia-smi")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_env.py needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run runs on CPU.")
    facts = collect(args.dry_run, args.n, args.repeats)
    args.out.write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
