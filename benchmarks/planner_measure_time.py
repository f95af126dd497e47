"""Setup time of the planner's fake-tensor measurement: every checkpointing mode (what ``"auto"`` needs) against the
one each block will run (what ``VitScaleStrategy()`` and any settled ``activation_checkpointing`` need); and every
mode again with torch's own ``FakeTensorMode`` dispatch in place of the planner's, which checks each op's namespace
to keep a measured step's collectives on its rank (``memory/local_collectives.py``): what that check costs.

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

    from lightning_vitscale._compat import FakeTensorMode
    from lightning_vitscale.cli.demo import TinyViT
    from lightning_vitscale.memory.fake_modes import FakeMode
    from lightning_vitscale.memory.planner import step_inputs

    with torch.device("meta"):
        model = TinyViT(dim=args.dim, depth=args.depth)
    example = torch.empty(args.batch, 3, 32, 32, device="meta")
    checked = FakeMode.__dict__["__torch_dispatch__"]
    variants = {"every mode": (None, checked), "settled (full)": (lambda *_: "full", checked),
                "settled (none)": (lambda *_: None, checked),
                "every mode, torch's dispatch": (None, FakeTensorMode.__torch_dispatch__)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.repeats):
            for name, (mode_of, dispatch) in variants.items():
                FakeMode.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
                start = time.perf_counter()
                step_inputs(model, example, precision="32-true", device="cpu", mode_of=mode_of)
                times[name].append(time.perf_counter() - start)
    finally:
        FakeMode.__torch_dispatch__ = checked  # type: ignore[method-assign]
    every = statistics.median(times["every mode"])
    print(f"torch {torch.__version__}; TinyViT depth {args.depth} dim {args.dim}, batch {args.batch}, "
          f"median of {args.repeats}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:28s} {median * 1e3:7.1f} ms  ({median / every:.3f}x)")


if __name__ == "__main__":
    main()
