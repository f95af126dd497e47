"""Rank script: torch's own FSDP1 writes the fixtures the FSDP1-era converter reads (nothing hand-made).

A tiny model, FSDP1 on the CPU over gloo (2 ranks), trained 2 steps, then saved the way FSDP1 scripts did:
``SHARDED_STATE_DICT`` through ``torch.distributed.checkpoint`` (``{"model": ..., "optim": ...}``) and FSDP1's
own ``FULL_STATE_DICT`` (the oracle, rank 0). Two recipes: plain units with activation checkpointing, and a
``torch.compile``-d model wrapped by FSDP1 (``use_orig_params=True``), whose keys keep ``_orig_mod.``.

Then ``LOCAL_STATE_DICT``, the per-rank ``torch.save`` files of padded flat parameters (DINOv2's format): a
small ViT-like model whose blocks are nested FSDP1 units (``ModuleWrapPolicy({Block})`` as DINOv2 wraps), with
``use_orig_params`` False and True (alignment padding inside each flat parameter) and True under bf16 mixed
precision (alignment counted in bf16 elements), each beside FSDP1's own ``FULL_STATE_DICT``.
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
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

warnings.filterwarnings("ignore")


def tiny_model() -> nn.Module:
    torch.manual_seed(0)  # the test builds the same plain model to load the result strictly
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Sequential(nn.Linear(7, 3), nn.Tanh()), nn.LayerNorm(3))


class Block(nn.Module):
    """A transformer-block stand-in: odd sizes, so FSDP1's flat parameters need alignment and world-size padding."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyViT(nn.Module):
    """Parameters outside the blocks (embedding, cls token, norm, head: the root unit's flat parameter), a buffer,
    and a head weight tied to the embedding's (FSDP1 flattens a shared parameter once)."""

    def __init__(self, dim: int = 5, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, dim))
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) + self.cls_token
        for block in self.blocks:
            x = block(x)
        return self.head((self.norm(x) * self.scale).type_as(x))


def local_model() -> nn.Module:
    """The model ``consolidate --from fsdp1-local --model tests.distributed.scripts.fsdp1_checkpoints:local_model``
    builds."""
    torch.manual_seed(0)
    return TinyViT()


LOCAL_RECIPES = {
    "flat": {"use_orig_params": False},
    "orig": {"use_orig_params": True},
    "bf16": {"use_orig_params": True, "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)},
}


def train_and_save_local(recipe: str, out: Path) -> None:
    fsdp = FSDP(local_model(), device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block}),
                **LOCAL_RECIPES[recipe])
    step(fsdp, lambda: torch.randn(4, 5))
    rank, folder = dist.get_rank(), out / "local" / recipe
    folder.mkdir(parents=True, exist_ok=True)
    with FSDP.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
        local = fsdp.state_dict()
    # DINOv2's FSDPCheckpointer layout: {"model": ..., "iteration": ...} in `<name>.rank_<rank>.pth`
    torch.save({"model": local, "iteration": 2}, folder / f"model_0000002.rank_{rank}.pth")
    full = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, full):
        full_state = fsdp.state_dict()
    if rank == 0:
        torch.save(full_state, folder / "full.pt")


def step(fsdp: nn.Module, batch) -> None:
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(2):
        fsdp(batch()).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


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
    for recipe in LOCAL_RECIPES:
        train_and_save_local(recipe, Path(sys.argv[1]))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
