"""The ordered pipeline that turns a plain model into the recipe; one screen, each step says why."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vitscale._compat import MixedPrecisionPolicy
from lightning_vitscale.activation_checkpointing import apply_activation_checkpointing, is_self_checkpointing
from lightning_vitscale.fsdp import broadcast_module_states, shard_module
from lightning_vitscale.matching import describe_blocks, find_blocks
from lightning_vitscale.materialize import has_meta_tensors, materialize
from lightning_vitscale.memory import full_bytes, local_bytes
from lightning_vitscale.plan import ParallelPlan
from lightning_vitscale.policies import ParallelConfig


class NoBlocksMatchedError(ValueError):
    """The user named block classes or a predicate that matched nothing: sharding would silently be coarse."""


def parallelize(
    root_unit: nn.Module,
    model: nn.Module,
    mesh: DeviceMesh,
    config: ParallelConfig,
    mp_policy: MixedPrecisionPolicy,
    device: torch.device,
    precision_name: str = "32-true",
) -> ParallelPlan:
    """Apply the recipe to ``model`` (held by ``root_unit``, the module Lightning actually calls).

    Order matters: blocks are found before anything rewrites the tree; checkpointing patches block
    forwards before FSDP registers its hooks on them; blocks are sharded bottom-up before the outer unit,
    so the outer unit only takes what no block owns; meta parameters are materialised last, shard by shard.
    """
    if not any(True for _ in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no parameters, so there is nothing to shard. Create the layers in"
            " `__init__` or in `configure_model()` (which VitScaleStrategy calls before sharding)."
        )
    blocks = [(name, block) for name, block in find_blocks(model, config.sharding.blocks) if _has_params(block)]
    if config.sharding.blocks is not None and not blocks:
        raise NoBlocksMatchedError(
            f"`blocks={config.sharding.blocks!r}` matched no module with parameters in {type(model).__name__}."
            " Pass the class of the repeated block (e.g. blocks={MyBlock}) or leave `blocks=None` to find them."
        )
    described = describe_blocks(blocks)  # before FSDP renames the classes (FSDP<Block>)
    notes = [] if blocks else [f"no repeated blocks in {type(model).__name__}: one outer FSDP unit only"]

    # 1. Same starting weights everywhere (DDP's guarantee), unless parameters are still meta.
    if not has_meta_tensors(model):
        broadcast_module_states(model, mesh)

    # 2. Activation checkpointing, skipping blocks that already checkpoint themselves (no double recompute).
    self_ckpt = [name for name, block in blocks if is_self_checkpointing(block)]
    chosen = [
        (name, block)
        for index, (name, block) in enumerate(blocks)
        if name not in self_ckpt and config.checkpointing.selects(index, name, block)
    ]
    apply_activation_checkpointing([block for _, block in chosen])

    # 3. Each block its own unit: peak memory is one block's gathered parameters, not the model's.
    for _, block in blocks:
        shard_module(block, mesh, mp_policy, config.sharding.reshard_after_forward)

    # 4. The outer unit on the module Lightning calls, so its pre-forward hook gathers the rest.
    outer_reshard = config.sharding.reshard_after_forward
    shard_module(root_unit, mesh, mp_policy, None if outer_reshard is None else bool(outer_reshard))

    # 5. Meta-initialised models get memory for their local shards only, then their reset_parameters().
    zero_filled = materialize(root_unit, device)

    params = list(model.parameters())
    return ParallelPlan(
        world_size=mesh.size(),
        blocks=described,
        block_names=[name for name, _ in blocks],
        units=len(blocks) + 1,
        checkpointed=[name for name, _ in chosen],
        self_checkpointed=self_ckpt,
        num_params=sum(p.numel() for p in params),
        param_bytes_full=full_bytes(params),
        param_bytes_local=local_bytes(params),
        precision=precision_name,
        notes=notes + ([f"{len(zero_filled)} meta tensor(s) had no initialiser: zero-filled"] if zero_filled else []),
    )


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
