"""Rank script: every example x backbone choice through its own CLI, under ``"ddp"`` and ``"vitscale"``, in one launch.

``example_clis.py OUT_DIR WORK_DIR name1,name2``: scenarios are named ``<case>/<strategy>``; WORK_DIR holds the
written default data (the detection COCO folder and the video mp4 files, written on the first fit that needs them
and read back by every later one) and each run's logs. Each fit is the CLI's ``fast_dev_run``: one training batch
and one validation batch, or ``PARITY_STEPS`` of each where the case is compared with DDP's losses step by step.
Results go to OUT_DIR/rank<R>.json via ``run_scenarios``.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning.pytorch as pl

from examples import classification, detection, video
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
WORK = sys.argv.pop(2)  # run_scenarios reads argv[1] (out dir) and argv[2] (names)
CPU2 = ["--trainer.accelerator=cpu", "--trainer.devices=2"]
PARITY_STEPS = 4  # the bigger backbones (ViTDet, MViTv2-S): DDP's losses over a few fp32 steps, not just one
SMALL = ["--data.num_train=64", "--data.num_val=32"]  # the written defaults: 8 batches of 4 per rank, 4 for val
CASES: dict[str, tuple[Any, list[str], int]] = {  # case -> (example module, its extra args, fast_dev_run batches)
    "classification": (classification, [], 1),
    "detection": (detection, [*SMALL, "--data.batch_size=4"], PARITY_STEPS),  # its default backbone: ViTDet
    "video": (video, SMALL, 1),  # the factorised space-time ViT
    "video-mvit_v2_s": (video, [*SMALL, "--model.backbone=mvit_v2_s", "--data.batch_size=4"], PARITY_STEPS),
}


class Record(pl.Callback):
    """Every training loss, and the validation batches run."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.val_batches += 1


def fit(case: str, strategy: str) -> dict:
    module, extra, batches = CASES[case]
    out = f"{WORK}/runs/{case}_{strategy}"
    args = [*CPU2, f"--trainer.strategy={strategy}", f"--trainer.fast_dev_run={batches}", *extra,
            f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}"]  # fmt: skip
    if module is not classification:  # written once as files, then read back like a user's
        args.append(f"--data.cache_dir={WORK}/cache")
    cli = module.main(args, run=False)
    record = Record()
    cli.trainer.callbacks.append(record)
    cli.trainer.fit(cli.model, cli.datamodule)
    plan = getattr(cli.trainer.strategy, "plan", None)
    return {
        "strategy": type(cli.trainer.strategy).__name__,
        "precision": cli.trainer.precision,
        "steps": cli.trainer.global_step,
        "losses": record.losses,
        "val_batches": record.val_batches,
        "blocks": plan.blocks if plan else None,
    }


SCENARIOS = {f"{c}/{s}": (lambda a=c, b=s: fit(a, b)) for c in CASES for s in ("vitscale", "ddp")}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
