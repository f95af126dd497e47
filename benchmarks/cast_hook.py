"""Per-call cost of the O2 input-cast pre-hook (precision/casting.py) that the outer layers, and on one device the
blocks joined to the outer unit, carry: `python benchmarks/cast_hook.py` (median of 5 x 20,000 calls)."""

from __future__ import annotations

import time

import torch
from torch import nn

from lightning_vitscale.precision.casting import cast_floating_inputs


def per_call_us(module: nn.Module, x: torch.Tensor, calls: int = 20000, rounds: int = 5) -> float:
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(runs)[rounds // 2]


def main() -> None:
    hooked, plain = nn.Identity(), nn.Identity()
    cast_floating_inputs([hooked], torch.bfloat16)
    bf16, fp32 = torch.randn(2, 65, 64, dtype=torch.bfloat16), torch.randn(2, 65, 64)
    for name, module, x in (("plain", plain, bf16), ("hooked, bf16 input", hooked, bf16),
                            ("hooked, fp32 input", hooked, fp32)):
        print(f"{name}: median {per_call_us(module, x):.2f} us/call")


if __name__ == "__main__":
    main()
