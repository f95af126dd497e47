"""Setup time of the planner's fake-tensor measurement: every checkpointing mode (what ``"auto"`` needs) against the
one each block will run (what ``VitScaleStrategy()`` and any settled ``activation_checkpointing`` need).

Usage::

    python benchmarks/planner_measure_time.py              # the demo ViT, 6 blocks, dim 128, batch 8, 10 repeats

One process, the model on the meta device (nothing allocated), ``step_inputs`` as setup calls it; the median of
``--repeats`` calls of each, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch

    from lightning_vitscale.cli.demo import TinyViT
    from lightning_vitscale.memory.planner import step_inputs

    with torch.device("meta"):
        model = TinyViT(dim=args.dim, depth=args.depth)
    example = torch.empty(args.batch, 3, 32, 32, device="meta")
    variants = {"every mode": None, "settled (full)": lambda *_: "full", "settled (none)": lambda *_: None}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, mode_of in variants.items():
            start = time.perf_counter()
            step_inputs(model, example, precision="32-true", device="cpu", mode_of=mode_of)
            times[name].append(time.perf_counter() - start)
    every = statistics.median(times["every mode"])
    print(f"torch {torch.__version__}; TinyViT depth {args.depth} dim {args.dim}, batch {args.batch}, "
          f"median of {args.repeats}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:16s} {median * 1e3:7.1f} ms  ({median / every:.2f}x)")


if __name__ == "__main__":
    main()
