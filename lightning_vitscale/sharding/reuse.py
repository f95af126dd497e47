"""Reusing a LightningModule that a VitScaleStrategy already sharded: only under the settings it was sharded with."""

from __future__ import annotations

from typing import Any

import torch

from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.precision import PrecisionPolicy
from lightning_vitscale.sharding.settings import ParallelConfig


class ShardedModuleReuseError(RuntimeError):
    """A LightningModule sharded under some settings was handed to a Trainer with other settings."""


def check_reusable(used: dict[str, Any], wanted: dict[str, Any]) -> None:
    """A sharded module is rebuilt by nobody: FSDP units, checkpointing and casts are in place. Refuse to pretend."""
    changed = [f"{key} {used[key]!r} -> {wanted[key]!r}" for key in wanted if used.get(key) != wanted[key]]
    if changed:
        raise ShardedModuleReuseError(
            "This LightningModule was already sharded by a VitScaleStrategy with other settings ("
            + "; ".join(changed)
            + "). Its FSDP units, activation checkpointing and precision casts cannot be undone in place. Build a"
            " new LightningModule instance for this Trainer, or pass the same strategy settings as before."
        )


def sharding_signature(
    config: ParallelConfig,
    precision: PrecisionPolicy,
    world_size: int,
    device: torch.device,
    kernels: KernelPolicy | None = None,
) -> dict[str, Any]:
    """The settings a sharded module was built with; another Trainer may reuse it only with the same ones.

    ``kernels``: the policy ``config.kernels`` resolved to on ``device``, where known (what was built)."""
    return {
        "blocks=": config.sharding.blocks,
        "reshard_after_forward=": config.sharding.reshard_after_forward,
        "sharding=": config.sharding.layout,
        "blocks_per_unit=": config.sharding.blocks_per_unit,
        "offload=": config.sharding.offload,
        "activation_checkpointing=": config.checkpointing.blocks,
        "priority=": config.priority,
        "kernels=": kernels if kernels is not None else config.kernels,
        "precision": precision,
        "world size": world_size,
        "device": device,
    }
