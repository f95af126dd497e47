"""The memory planner against measured ``Trainer.fit`` steps of published architectures (Lightning's own loop).

Usage::

    python benchmarks/planner_trainer_fit.py     # vit_b_16, timm vit_small: AC off/full/selective, 2 batches
    python benchmarks/planner_trainer_fit.py --cells deit_tiny:off:8 vit_b_16:off:16:manual

Each cell is ``model:ac:batch[:loop]`` as ``tests/distributed/scripts/planner_fit.py`` takes it (loop: ``auto``,
``manual``, ``acc2``); all cells run in one launch on ``--ranks`` CPU ranks (gloo) with ``MALLOC_MMAP_THRESHOLD_``
set, so that freed memory leaves RSS. Reported: the predicted and the measured step increment over the resident
state (sharded parameters, optimizer state, norms, batch), the larger of the ranks.
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
from tests.helpers.peak import MMAP_THRESHOLD_ENV  # noqa: E402

CELLS = [f"{model}:{ac}:{batch}" for model, batches in (("vit_b_16", (8, 16)), ("vit_small", (16, 32)))
         for ac in ("off", "full", "selective") for batch in batches] + ["vit_b_16:off:16:observed"]
MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cells", nargs="+", default=CELLS, metavar="MODEL:AC:BATCH[:LOOP]")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        assert_ok(torchrun(ROOT / "tests/distributed/scripts/planner_fit.py", out, ",".join(args.cells),
                           nprocs=args.ranks, timeout=args.timeout, **MMAP_THRESHOLD_ENV))
        results = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    print("| model | AC | batch/rank | loop | predicted MiB | measured MiB | predicted / measured | peak at |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for cell in args.cells:
        model, ac, batch, *loop = cell.split(":")
        predicted = max(r[cell]["predicted"] for r in results)
        measured = max(r[cell]["measured"] for r in results)
        worst = max(worst, abs(predicted / measured - 1))
        print(f"| {model} | {ac} | {batch} | {(loop or ['auto'])[0]} | {predicted / MIB:.1f} | {measured / MIB:.1f} |"
              f" {predicted / measured:.3f} | {results[0][cell]['phase']} |", flush=True)
    print(f"\nlargest deviation: {worst:.1%}")


if __name__ == "__main__":
    main()
