"""What keeping a measured step's collectives on its rank costs the planner (``memory/local_collectives.py``): the
fake mode checks each op's namespace before dispatching it, one Python call per op of the measurement.

Usage::

    python benchmarks/fake_mode_collectives_cost.py    # the demo ViT, 6 blocks, dim 128, batch 8, 15 repeats

One process, the model on the meta device, ``step_inputs`` as setup calls it (every checkpointing mode, what
``"auto"`` measures), with the check and with torch's own ``FakeTensorMode`` dispatch in its place, interleaved;
the median of each.
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
    parser.add_argument("--repeats", type=int, default=15)
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
    variants = {"collectives kept on the rank": checked, "torch's dispatch alone": FakeTensorMode.__torch_dispatch__}
    times: dict[str, list[float]] = {name: [] for name in variants}
    step_inputs(model, example, precision="32-true", device="cpu")  # warm: caches, lazy imports
    try:
        for _ in range(args.repeats):
            for name, dispatch in variants.items():
                FakeMode.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
                start = time.perf_counter()
                step_inputs(model, example, precision="32-true", device="cpu")
                times[name].append(time.perf_counter() - start)
    finally:
        FakeMode.__torch_dispatch__ = checked  # type: ignore[method-assign]
    base = statistics.median(times["torch's dispatch alone"])
    print(f"torch {torch.__version__}; TinyViT depth {args.depth} dim {args.dim}, batch {args.batch}, "
          f"median of {args.repeats}, interleaved")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:30s} {median * 1e3:7.1f} ms  ({median / base:.3f}x)")


if __name__ == "__main__":
    main()
