"""Rank script: the classification backbones, the video example's MViTv2-S and the pretraining example through their
own CLIs, under ``"ddp"`` and ``"vitscale"``, in one launch (the process group is made once; each fit is a few steps).

``examples_matrix.py OUT_DIR WORK_DIR name1,name2``: WORK_DIR holds the local weights / configs the backbones read,
and the video data the MViTv2-S fits write once and read back. Scenarios are named ``<what>/<strategy>``; results
go to OUT_DIR/rank<R>.json via ``run_scenarios``. (The MViTv2-S fits ran in a launch of their own,
``example_clis.py``, with the other examples' ``fast_dev_run``; those are now checked by test_convergence.py's
runs, launched as a user would, over a whole epoch of steps.)
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from examples import classification, pretraining, video
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
WORK = sys.argv.pop(2)  # run_scenarios reads argv[1] (out dir) and argv[2] (names)
CPU2 = ["--trainer.accelerator=cpu", "--trainer.devices=2"]
QUIET = [*CPU2, "--trainer.logger=false",
         "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
         "--trainer.enable_model_summary=false"]  # fmt: skip
BACKBONES = {
    "timm": ["--model.backbone=timm:vit_tiny_patch16_224", f"--model.weights={WORK}/timm.safetensors"],
    "torchvision": ["--model.backbone=torchvision:vit_b_16", "--data.img_size=32"],
    "hf": [f"--model.backbone=hf:{WORK}/hf_config"],
}
PROBE_WEIGHT = "blocks.0.attn.qkv.weight"  # a timm block parameter, compared with the weights file after sharding


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().clone()


class WeightsProbe(pl.Callback):
    """After setup (sharded or wrapped), before any step: the model holds the file's values."""

    def __init__(self) -> None:
        self.matches: bool | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from safetensors.torch import load_file

        expected = load_file(f"{WORK}/timm.safetensors")[PROBE_WEIGHT].double()
        self.matches = torch.equal(full(pl_module.net.get_parameter(PROBE_WEIGHT)), expected)


def backbone(source: str, strategy: str) -> dict:
    probe = WeightsProbe()
    root = f"--trainer.default_root_dir={WORK}/runs/{source}_{strategy}"  # where the CLI saves its config.yaml
    cli = classification.main([*QUIET, root, f"--trainer.strategy={strategy}", "--trainer.fast_dev_run=true",
                               *BACKBONES[source]], run=False)  # fmt: skip
    if source == "timm":  # the one scenario given a weights file
        cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    plan = getattr(cli.trainer.strategy, "plan", None)
    return {"steps": cli.trainer.global_step, "blocks": plan.blocks if plan else None, "weights_match": probe.matches}


class EMAProbe(pl.Callback):
    """Records the student after every optimizer step and the momentum used, to recompute the teacher by hand.

    Callback hooks run before the module's, so at ``on_train_batch_end`` the teacher is not yet updated for this
    step; at ``on_train_end`` it is.
    """

    def __init__(self) -> None:
        self.start: list[torch.Tensor] = []
        self.teacher_start: list[torch.Tensor] = []
        self.steps: list[tuple[float, list[torch.Tensor]]] = []
        self.end: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.start = [full(p) for p in pl_module.student.parameters()]
        self.teacher_start = [full(p) for p in pl_module.teacher.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        momentum = pl_module.teacher_momentum(trainer.global_step)
        self.steps.append((momentum, [full(p) for p in pl_module.student.parameters()]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.end = [full(p) for p in pl_module.teacher.parameters()]


def by_hand(probe: EMAProbe) -> list[torch.Tensor]:
    teacher = [t.clone() for t in probe.start]
    for momentum, student in probe.steps:
        teacher = [momentum * t + (1 - momentum) * s for t, s in zip(teacher, student, strict=True)]
    return teacher


def local_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole module) of ``module``'s parameters."""
    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())
    return local, sum(p.numel() * p.element_size() for p in module.parameters())


def dino(strategy: str) -> dict:
    probe = EMAProbe()
    # 3 steps then validation (the k-NN path); momentum 0.5: the teacher moves a lot
    steps = ["--trainer.max_steps=3", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2"]
    args = [*QUIET, f"--trainer.default_root_dir={WORK}/runs/dino_{strategy}", f"--trainer.strategy={strategy}", *steps]
    args.append("--trainer.num_sanity_val_steps=0")
    args.append("--model.momentum=0.5")
    args.append("--data.batch_size=64")  # the k-NN bank: 2 batches x 64 images x 2 ranks (the default is 16 per rank)
    cli = pretraining.main(args, run=False)
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    model = cli.model
    hand = by_hand(probe)
    plan = getattr(cli.trainer.strategy, "plan", None)
    return {
        "steps": len(probe.steps),
        "teacher_started_as_student": all(torch.equal(t, s) for t, s in zip(probe.teacher_start, probe.start)),
        "ema_max_error": max((t - h).abs().max().item() for t, h in zip(probe.end, hand, strict=True)),
        "teacher_moved": max((t - s).abs().max().item() for t, s in zip(probe.end, probe.start, strict=True)),
        "teacher_frozen": not any(p.requires_grad for p in model.teacher.parameters()),
        "teacher_sharded": all(isinstance(p, DTensor) for p in model.teacher.parameters()),
        "teacher_bytes": local_bytes(model.teacher),
        "student_bytes": local_bytes(model.student),
        "block_names": plan.block_names if plan else None,
        "knn_acc": float(cli.trainer.callback_metrics["knn_acc"]),
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


MVIT_STEPS = 4  # DDP's losses over a few fp32 optimizer steps, not only the first (and as many validation batches)
# the written default, small: 8 batches of 4 per rank, 4 for validation, 4-frame clips (8 by default; any even
# count works): the two fits took 29 s with 8 frames, 24 s with 4 (2026-11-28)
MVIT = ["--model.backbone=mvit_v2_s", "--data.num_train=64", "--data.num_val=32", "--data.batch_size=4",
        "--data.num_frames=4"]  # fmt: skip


def mvit(strategy: str) -> dict:
    """``python examples/video.py fit --model.backbone=mvit_v2_s``'s ``fast_dev_run``, on its written default data."""
    out = f"{WORK}/runs/mvit_{strategy}"
    args = [*CPU2, f"--trainer.strategy={strategy}", f"--trainer.fast_dev_run={MVIT_STEPS}", *MVIT,
            f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}",
            f"--data.cache_dir={WORK}/cache"]  # fmt: skip
    cli = video.main(args, run=False)
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


STRATEGIES = ("vitscale", "ddp")
SCENARIOS = {f"{src}/{s}": (lambda a=src, b=s: backbone(a, b)) for src in BACKBONES for s in STRATEGIES}
SCENARIOS |= {f"dino/{s}": (lambda b=s: dino(b)) for s in STRATEGIES}
SCENARIOS |= {f"video-mvit_v2_s/{s}": (lambda b=s: mvit(b)) for s in STRATEGIES}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
