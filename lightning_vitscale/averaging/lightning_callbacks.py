"""Lightning's ``WeightAveraging`` (EMA/SWA via ``torch.optim.swa_utils``) and ``StochasticWeightAveraging``, sharded.

Both deep-copy the LightningModule in ``setup`` (before the strategy shards it), then average between the copy's
and the model's parameters by position: a plain copy fails on DTensors ("got mixed torch.Tensor and DTensor"). The
copy sharded like the model makes each op local on matching shards: DDP's averages, at 1/N of a model per rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_vitscale._compat import averaged_model, averaging_device


def shard_averaged_copies(
    callbacks: list[Callback], model: nn.Module, device: torch.device, checkpointing: bool = False
) -> int:
    """Shard the averaged copy of every weight-averaging callback like ``model``; returns how many were sharded.
    Their checkpoint state is refused (at once if ``checkpointing``, else at the first save): ``_NO_CHECKPOINTS``."""
    sharded = 0
    for callback in callbacks:
        copy = _averaged_copy(callback)
        if copy is None:
            continue
        if checkpointing:
            raise ValueError(_NO_CHECKPOINTS.format(name=type(callback).__name__))
        copy.register_state_dict_pre_hook(partial(_refuse_checkpoint, type(callback).__name__))
        wanted = averaging_device(callback)
        if wanted is not None and torch.device(wanted).type != device.type:
            raise ValueError(
                f"{type(callback).__name__}(device={wanted!r}) cannot keep its averaged copy on another device under"
                f" VitScaleStrategy: the copy is sharded like the model, on {device.type} (1/N of the model per"
                " rank). Drop `device=`, or use lightning_vitscale.ShardedEMA."
            )
        shard_like(copy, model)
        sharded += 1
    return sharded


_NO_CHECKPOINTS = (
    "{name} cannot be checkpointed under VitScaleStrategy: Lightning keeps its averaged and current weights"
    " outside the sharded part of the checkpoint, which rank 0 writes alone, so the other ranks' shards would be"
    " lost. Pass Trainer(enable_checkpointing=False) and save no checkpoint while it runs, or use"
    " lightning_vitscale.ShardedEMA, whose state is saved in the sharded checkpoint."
)


def _refuse_checkpoint(name: str, *args: Any) -> None:
    raise ValueError(_NO_CHECKPOINTS.format(name=name))


def _averaged_copy(callback: Callback) -> nn.Module | None:
    if isinstance(callback, WeightAveraging):
        averaged = averaged_model(callback)
        return None if averaged is None else averaged.module
    if isinstance(callback, StochasticWeightAveraging):
        return averaged_model(callback)
    return None


@torch.no_grad()
def shard_like(copy: nn.Module, model: nn.Module) -> None:
    """Each parameter of ``copy`` replaced by this rank's shard of its values, placed like ``model``'s (no
    communication), registered under its name: the positions the callbacks pair parameters by stay."""
    targets = dict(model.named_parameters())
    for name, param in list(copy.named_parameters()):
        target = targets.get(name)
        if not isinstance(target, DTensor) or isinstance(param, DTensor):
            continue
        if param.shape != target.shape:
            raise ValueError(
                f"The averaged copy's `{name}` has shape {tuple(param.shape)}, the model's {tuple(target.shape)}:"
                " the model changed after the weight-averaging callback copied it."
            )
        full = param.detach().to(target.device)
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        owner, _, attr = name.rpartition(".")
        copy.get_submodule(owner).register_parameter(attr, nn.Parameter(local, requires_grad=param.requires_grad))
