"""What attention routing itself costs: checkpointed blocks with and without the router, eager and compiled.

Usage::

    python benchmarks/attention_routing.py                  # CPU, small blocks (~1-2 min, most of it compiling)
    python benchmarks/attention_routing.py --device cuda --dtype bfloat16 --dim 1024 --heads 16 --seq 197 --batch 64

``route`` is the router with a pass-through backend that calls SDPA itself, so the kernel is the same and any
difference is the mechanism: a ``TorchFunctionMode`` entered around each block's forward. On CUDA with the
``[xformers]`` extra a third variant routes to xformers for real. Each variant is timed forward + backward on
one fixed batch, the variants taking turns step by step; the median of ``--steps`` steps after ``--warmup`` is
reported, with the ratio to ``sdpa`` of the same eager/compiled mode measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vitscale.cli.demo import Block
from lightning_vitscale.kernels.attention import XFORMERS, AttentionBackend, AttentionRouter, route_blocks
from lightning_vitscale.kernels.compile import apply_regional_compile
from lightning_vitscale.sharding.activation_checkpointing import apply_activation_checkpointing

PASS_THROUGH = AttentionBackend("route", F.scaled_dot_product_attention, lambda device: True)


def build(variant: str, compiled: bool, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(args.dim, args.heads).to(args.device, getattr(torch, args.dtype)) for _ in range(args.depth)]
    if variant != "sdpa":
        route_blocks(blocks, AttentionRouter(backend=PASS_THROUGH if variant == "route" else XFORMERS))
    apply_activation_checkpointing(blocks)
    if compiled:
        apply_regional_compile(blocks)
    return nn.Sequential(*blocks)


def step_ms(model: nn.Module, x: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model(x).float().square().mean().backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def time_variants(models: dict[str, nn.Module], x: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per step; the variants take turns step by step, so drift (clock, allocator, other load) hits
    all of them alike instead of whichever ran first."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.warmup + args.steps):
        for name, model in models.items():
            ms = step_ms(model, x)
            if i >= args.warmup:
                times[name].append(ms)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    variants = ["sdpa", "route"] + (["xformers"] if XFORMERS.available(device) else [])
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=getattr(torch, args.dtype))
    x.requires_grad_(True)
    print(
        f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__},"
        f" {args.dtype}, {args.depth} blocks dim {args.dim} heads {args.heads}, batch {args.batch} x seq {args.seq},"
        f" activation checkpointing on, median of {args.steps} steps after {args.warmup}"
    )
    print("| mode | attention | ms per fwd+bwd | vs sdpa |\n|---|---|---|---|")
    for compiled in (False, True):
        torch._dynamo.reset()
        medians = time_variants({variant: build(variant, compiled, args) for variant in variants}, x, args)
        for variant, ms in medians.items():
            mode = "compiled" if compiled else "eager"
            print(f"| {mode} | {variant} | {ms:.2f} | {ms / medians['sdpa']:.2f}x |")


if __name__ == "__main__":
    main()
