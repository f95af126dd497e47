"""AdamW + linear-warmup cosine schedule shared by the examples (no decay on norms/biases/embeddings)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig


def adamw_cosine(
    module: pl.LightningModule, lr: float, weight_decay: float, warmup_frac: float
) -> OptimizerLRSchedulerConfig:
    """Optimizer config for ``configure_optimizers``; steps the LR per batch over the whole run.

    Built from ``module.parameters()`` at call time, i.e. after the strategy has sharded them.
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    no_decay = {n for n, p in named if p.ndim < 2 or "embed" in n.rsplit(".", 1)[-1] or n.endswith("token")}
    groups = [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))
    total = max(1, int(module.trainer.estimated_stepping_batches))
    warmup = max(1, int(total * warmup_frac))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
