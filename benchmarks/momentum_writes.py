"""User code writing to parameters, tried: a momentum encoder updated by lightly's ``update_momentum``
(``ema.data = ema.data * m + p.data * (1 - m)``) or DINO's ``p_k.data.mul_(m).add_(...)``, at the start of
``training_step``, between its two forwards, after them, or in ``on_train_batch_end``; 5 steps under DDP and under
``VitScaleStrategy()`` / ``priority="memory"`` from the same weights and data. Per cell, the largest relative
difference of the losses to DDP's (the loss reads the teacher, so an update lost or late shows), or the error.

Usage (ranks started by torch's launcher; ~1 min on 2 cores)::

    python -m torch.distributed.run --nproc-per-node=2 benchmarks/momentum_writes.py
    python -m torch.distributed.run --nproc-per-node=1 benchmarks/momentum_writes.py --precision bf16-mixed

The model is the zoo's hand-written ViT (``tests/helpers/momentum.py``, the tests' model); RESULTS.md's table of
2026-12-05 came from timm's ViT of ``habits_sweep.py`` run the same way, before and after the fix.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.momentum import STRATEGIES, fit_momentum  # noqa: E402 - after the checkout is importable

PLACES = ("start", "between", "end", "batch_end")


def cell(update: str, where: str, precision: str) -> dict[str, object]:
    devices = int(os.environ.get("WORLD_SIZE", 1))
    losses: dict[str, object] = {}
    for name, make in STRATEGIES.items():
        try:
            losses[name] = fit_momentum(make(), update, where, devices, precision, steps=5).losses
        except Exception as error:  # noqa: BLE001 - an outcome the sweep records
            losses[name] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}"
    ddp = losses["ddp"]
    row: dict[str, object] = {}
    for name in ("default", "memory"):
        ours = losses[name]
        if isinstance(ours, list) and isinstance(ddp, list):
            row[name] = max(abs(a - b) / abs(b) for a, b in zip(ours, ddp))
        else:
            row[name] = ours if isinstance(ours, str) else f"DDP: {ddp}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = {(update, where): cell(update, where, args.precision) for update in ("lightly", "dino") for where in PLACES}
    if int(os.environ.get("RANK", 0)) == 0:
        print("| update | where | default vs DDP | memory vs DDP |\n|---|---|---|---|")
        for (update, where), row in rows.items():
            shown = [f"{v:.2g}" if isinstance(v, float) else str(v) for v in row.values()]
            print(f"| {update} | {where} | " + " | ".join(shown) + " |")


if __name__ == "__main__":
    main()
