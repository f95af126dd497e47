"""Predicted vs measured per-rank peak memory of a training step on CPU ranks (the memory planner's accuracy).

Usage::

    python benchmarks/memory_planner.py                # 2 shapes x 1/2/4 ranks x AC on/off x fp32/bf16-mixed
    python benchmarks/memory_planner.py --ranks 2      # one rank count

Each rank count is one launch of ``tests/distributed/scripts/memory_planner.py`` (torch's elastic launcher, gloo).
Measured = bytes of live tensor storages when the step starts (garbage-collector scan, deduplicated) + the
largest running sum of torch's CPU allocator events during the step (``torch.profiler``, ``profile_memory=True``;
the profiler also runs through the previous step so that frees of its buffers are seen). Predicted = the
planner's model of the same step (activations measured on fake tensors, the rest counted from shapes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.launch import assert_ok, torchrun  # noqa: E402

SCENARIOS = [f"{shape}:{ac}:{precision}" for shape in ("wide", "long") for precision in ("32-true", "bf16-mixed")
             for ac in ("off", "on")]
MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--scenarios", nargs="+", default=SCENARIOS, metavar="SHAPE:AC:PRECISION",
                        help="cells to run, e.g. wide:on:bf16-mixed (default: all eight)")
    args = parser.parse_args()
    print("| shape | AC | precision | ranks | predicted MiB | measured MiB (max rank) | predicted / measured |"
          " predicted peak at |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            assert_ok(torchrun(ROOT / "tests/distributed/scripts/memory_planner.py", out, ",".join(args.scenarios),
                               nprocs=ranks, timeout=args.timeout))
            results = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        for name in args.scenarios:
            shape, ac, precision = name.split(":")
            measured = max(r[name]["measured"] for r in results)
            predicted = max(r[name]["predicted"] for r in results)
            worst = max(worst, abs(predicted / measured - 1))
            print(f"| {shape} | {ac} | {precision} | {ranks} | {predicted / MIB:.1f} | {measured / MIB:.1f} |"
                  f" {predicted / measured:.3f} | {results[0][name]['phase']} |", flush=True)
    print(f"\nlargest deviation: {worst:.1%}")


if __name__ == "__main__":
    main()
