"""Rank script: torch's own FSDP1 writes the fixtures the FSDP1-era converter reads (nothing hand-made).

A tiny model, FSDP1 on the CPU over gloo (2 ranks), trained 2 steps, then saved the way FSDP1 scripts did:
``SHARDED_STATE_DICT`` through ``torch.distributed.checkpoint`` (``{"model": ..., "optim": ...}``) and FSDP1's
own ``FULL_STATE_DICT`` (the oracle, rank 0). Two recipes: plain units with activation checkpointing, and a
``torch.compile``-d model wrapped by FSDP1 (``use_orig_params=True``), whose keys keep ``_orig_mod.``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

warnings.filterwarnings("ignore")


def tiny_model() -> nn.Module:
    torch.manual_seed(0)  # the test builds the same plain model to load the result strictly
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Sequential(nn.Linear(7, 3), nn.Tanh()), nn.LayerNorm(3))


def wrapped(recipe: str) -> nn.Module:
    model = tiny_model()
    if recipe == "compiled":
        return FSDP(torch.compile(model, backend="eager"), device_id=torch.device("cpu"), use_orig_params=True)
    fsdp = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    apply_activation_checkpointing(fsdp, check_fn=lambda module: isinstance(module, nn.Linear))
    return fsdp


def train_and_save(recipe: str, out: Path) -> None:
    fsdp = wrapped(recipe)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(2):
        fsdp(torch.randn(4, 5)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
        state = {"model": fsdp.state_dict(), "optim": FSDP.optim_state_dict(fsdp, optimizer)}
    dcp.save(state, checkpoint_id=out / recipe / "sharded")
    full = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, full):
        full_state = fsdp.state_dict()
    if dist.get_rank() == 0:
        torch.save(full_state, out / recipe / "full.pt")


def main() -> None:
    dist.init_process_group("gloo")
    for recipe in ("checkpointed", "compiled"):
        train_and_save(recipe, Path(sys.argv[1]))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
