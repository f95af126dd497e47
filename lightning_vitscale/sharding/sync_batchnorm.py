"""``Trainer(sync_batchnorm=True)``: BatchNorm layers become ``SyncBatchNorm`` before sharding, as under DDP.

DDP's ``setup`` converts them through the strategy's layer-sync plugin; a strategy that replaces ``setup`` has to
do the same or the flag is silently ignored (each rank would normalise over its own batch only). torch runs
``SyncBatchNorm`` on GPU modules only: on CPU, DDP fails at the first forward; here the setup refuses at once.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import BatchNormBase

# Device types torch's SyncBatchNorm accepts (its forward raises on any other when a process group is running).
SYNC_BATCHNORM_DEVICES = frozenset({"cuda", "hpu", "xpu"})


def apply_sync_batchnorm(layer_sync: LayerSync | None, module: nn.Module, device: torch.device) -> nn.Module:
    """Convert ``module``'s BatchNorm layers with Lightning's layer-sync plugin; refuse where torch cannot run it."""
    if layer_sync is None:
        return module
    plain = [name for name, m in module.named_modules()
             if isinstance(m, BatchNormBase) and not isinstance(m, nn.SyncBatchNorm)]
    if not plain:
        return module
    if device.type not in SYNC_BATCHNORM_DEVICES:
        raise ValueError(
            f"Trainer(sync_batchnorm=True) would turn {len(plain)} BatchNorm layer(s) of {type(module).__name__}"
            f" (e.g. `{plain[0]}`) into torch.nn.SyncBatchNorm, which torch runs on GPU modules only (DDP on"
            f" {device.type} fails at the first forward: 'SyncBatchNorm expected input tensor to be on GPU')."
            " Use Trainer(accelerator='cuda'), or drop sync_batchnorm=True (each rank then normalises over its own"
            " batch, as under DDP without it)."
        )
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError(
            f"Trainer(sync_batchnorm=True): {type(module).__name__} was already sharded by an earlier Trainer"
            " without it, so its BatchNorm layers can no longer be converted. Pass sync_batchnorm=True to the first"
            " Trainer that runs this model (or convert with torch.nn.SyncBatchNorm.convert_sync_batchnorm first)."
        )
    return layer_sync.apply(module)
