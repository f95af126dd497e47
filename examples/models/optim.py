"""AdamW + linear-warmup cosine schedule shared by the examples (no decay on norms/biases/embeddings)."""

from __future__ import annotations

import math
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig


def adamw_cosine(
    module: pl.LightningModule,
    lr: float,
    weight_decay: float,
    warmup_frac: float,
    lr_scale: Callable[[str], float] | None = None,
) -> OptimizerLRSchedulerConfig:
    """Optimizer config for ``configure_optimizers``; steps the LR per batch over the whole run.

    Built from ``module.parameters()`` at call time, i.e. after the strategy has sharded them; frozen parameters
    (``requires_grad=False``) are left out. ``lr_scale(name)`` multiplies a parameter's learning rate (layer-wise
    decay: one param group per scale and decay setting; the schedule scales every group alike).
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    no_decay = {n for n, p in named if p.ndim < 2 or "embed" in n.rsplit(".", 1)[-1] or n.endswith("token")}
    scale_of = lr_scale or (lambda name: 1.0)
    groups = []
    for scale in sorted({scale_of(n) for n, _ in named} or {1.0}):
        for wd, decays in ((weight_decay, True), (0.0, False)):
            params = [p for n, p in named if scale_of(n) == scale and (n not in no_decay) == decays]
            if params or lr_scale is None:  # without scales: the two groups as always (a resume needs them)
                groups.append({"params": params, "lr": lr * scale, "weight_decay": wd})
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))
    total = max(1, int(module.trainer.estimated_stepping_batches))
    warmup = max(1, int(total * warmup_frac))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
