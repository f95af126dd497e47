"""Rank script: models built in configure_model: exact initial weights vs DDP, the meta path's own init, memory."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale import ShardedModuleReuseError, VitScaleStrategy
from tests.helpers.models import HFViT, loader, timm_vit
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
warnings.filterwarnings("ignore", category=DeprecationWarning)


class Distinctive(nn.Module):
    """Own init through ``self.apply``: normal std 0.05, constant 0.3 biases, dropout (RNG use after the build)."""

    def __init__(self, dim: int = 64, depth: int = 4, orthogonal: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(3 * 32 * 32, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(0.1)) for _ in range(depth)
        )
        self.head = nn.Linear(dim, 10)
        self.apply(self._init)
        if orthogonal:
            nn.init.orthogonal_(self.head.weight)  # not elementwise: the meta path must say it cannot replay it

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.05)
            nn.init.constant_(module.bias, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def examples_vit() -> nn.Module:
    from examples.models.vit import VisionTransformer

    return VisionTransformer.from_size("tiny", img_size=32, in_chans=3, num_classes=10, patch_size=8)


BUILDERS = {"distinctive": Distinctive, "examples_vit": examples_vit, "timm": timm_vit, "hf": HFViT}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Built(L.LightningModule):
    """Builds its network in configure_model (the large-model habit); records losses and the device it sees."""

    def __init__(self, kind: str, **kwargs) -> None:
        super().__init__()
        self.kind, self.kwargs = kind, kwargs
        self.net: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = BUILDERS[self.kind](**self.kwargs)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_start(self) -> None:
        self.device_at_start = str(self.device)
        if self.kind == "examples_vit":  # the initial values, before any step moves them
            self.initial_fc1 = torch.cat([_full(b.mlp.fc1.weight).flatten() for b in self.net.blocks])
        if isinstance(self.net, Distinctive):
            linears = [block[0] for block in self.net.blocks]
            self.initial_weights = torch.cat([_full(m.weight).flatten() for m in linears])
            self.initial_biases = torch.cat([_full(m.bias) for m in linears])
            local = _local(linears[0].weight).contiguous()
            shards = [torch.empty_like(local) for _ in range(self.trainer.world_size)]
            torch.distributed.all_gather(shards, local)
            self.shards_differ = not torch.equal(shards[0], shards[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(strategy, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def fit(kind: str, strategy, **kwargs) -> tuple[Built, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = Built(kind, **kwargs)
    t = trainer(strategy)
    t.fit(model, loader(n=32))
    return model, t


def exact(kind: str) -> dict:
    ddp, _ = fit(kind, "ddp")
    ours, t = fit(kind, VitScaleStrategy())
    return {
        "ddp": ddp.losses, "vitscale": ours.losses, "path": t.strategy.plan.init_path,
        "device": ours.device_at_start, "summary": t.strategy.plan.summary(),
    }


def meta_stats() -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, t = fit("distinctive", VitScaleStrategy(init="meta"), orthogonal=True)
    vit, _ = fit("examples_vit", VitScaleStrategy(init="meta"))
    fc1 = vit.initial_fc1
    return {
        "path": t.strategy.plan.init_path,
        "weight_std": model.initial_weights.std().item(), "weight_mean": model.initial_weights.mean().item(),
        "bias_values": sorted(set(model.initial_biases.tolist())),
        "shards_differ": model.shards_differ,
        "warnings": [str(w.message) for w in caught if "could not be reproduced" in str(w.message)],
        "vit_fc1_std": fc1.std().item(),
        "finite": all(torch.isfinite(p.to_local()).all().item() for p in model.parameters()),
        "losses": model.losses,
    }


def meta_hybrid() -> dict:
    """``init="meta"`` under hybrid sharding with 1-rank shard groups: the two ranks are replicas of each other and
    must start from the same values (the seed per shard counts only the mesh dimensions that shard)."""
    model, t = fit("distinctive", VitScaleStrategy(init="meta", sharding=1))
    return {"path": t.strategy.plan.init_path, "replicas_differ": model.shards_differ}


def explicit_meta_refused() -> dict:
    class OnMeta(Built):
        def configure_model(self) -> None:
            if self.net is None:
                with torch.device("meta"):
                    self.net = Distinctive()

    model = OnMeta("distinctive")
    try:
        trainer(VitScaleStrategy(init="exact")).fit(model, loader(n=32))
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def reuse() -> dict:
    """A second Trainer may reuse the sharded module with the same settings, and is refused with others."""
    model, _ = fit("distinctive", VitScaleStrategy())
    again = trainer(VitScaleStrategy(), max_steps=4)
    again.fit(model, loader(n=32))
    try:
        trainer(VitScaleStrategy(activation_checkpointing=False), max_steps=6).fit(model, loader(n=32))
    except ShardedModuleReuseError as error:
        return {"reused_steps": len(model.losses), "error": str(error)}
    return {"reused_steps": len(model.losses), "error": None}


class Big(L.LightningModule):
    """A model much larger than Lightning's own allocations, built in configure_model; peak RSS across setup."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        self.layers: nn.Module | None = None

    def setup(self, stage: str) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # reset this process's peak RSS (VmHWM)
        self.rss_before = _status_bytes("VmRSS")

    def configure_model(self) -> None:
        if self.layers is None:
            blocks = [nn.Sequential(nn.Linear(self.width, self.width), nn.GELU()) for _ in range(self.depth)]
            self.layers = nn.Sequential(*blocks)

    def on_train_start(self) -> None:
        self.growth = _status_bytes("VmHWM") - self.rss_before

    def training_step(self, batch, batch_idx):
        return self.layers(torch.ones(2, self.width)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def memory() -> dict:
    model = Big(width=1024, depth=64)  # 64 x 1.05M params x 4 B = 269 MB
    # One block per unit, as the bound below assumes: rank 0 scatters its values unit by unit, so a rank also holds
    # one unit's full values for a moment, and the planner's unit size (blocks_per_unit=None) follows the host
    # memory free at the time (4 blocks of 4.2 MB here with 4.5 GiB free; more on an idler machine).
    t = trainer(VitScaleStrategy(blocks_per_unit=1), max_steps=1)
    t.fit(model, loader(n=16))
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {
        "full": full, "local": local, "growth": model.growth, "path": t.strategy.plan.init_path,
        "trained": t.global_step, "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
    }


SCENARIOS = {f"exact/{kind}": (lambda kind=kind: exact(kind)) for kind in BUILDERS}
SCENARIOS.update(meta_stats=meta_stats, meta_hybrid=meta_hybrid, explicit_meta_refused=explicit_meta_refused,
                 reuse=reuse, memory=memory)


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
