"""Rank script for tensor parallelism on 4 CPU ranks: ``tensor_parallel.py OUT``.

For each backbone (the examples' ViT, timm's, HF ViT and DINOv2), DDP at a global batch of 8 (2 per rank), then
``VitScaleStrategy(tensor_parallel=2)`` (2 data-parallel ranks of 4 samples) and ``tensor_parallel=4`` (one of 8),
all through ``Trainer.fit`` with gradient clipping; each rank starts from its own random weights, so only rank 0's
broadcast makes them agree. Then checkpoints: HF ViT saved under TP=2 x FSDP=2 resumed under FSDP=4 (tensor_parallel=1),
the examples' ViT (packed qkv) resumed under TP=2 and refused under TP=1. Writes ``rank{r}.json``: losses, the
sampler split, state bytes, the plan summary, what each resume restored.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import ShardedEMA, VitScaleStrategy, measure_state_bytes
from lightning_vitscale.checkpoint.consolidate import load_consolidated
from lightning_vitscale.sharding import TensorLayoutError
from tests.helpers.state import full as full_tensor
from tests.helpers.state import snapshot

warnings.filterwarnings("ignore")
IMAGE, PATCH, CLASSES, GLOBAL_BATCH, STEPS = 8, 4, 10, 8, 4
SIZE = {"embed_dim": 32, "depth": 2, "num_heads": 4}


def examples_vit():
    from examples.models.vit import VisionTransformer

    return VisionTransformer(IMAGE, PATCH, 3, CLASSES, mlp_ratio=2.0, **SIZE)


def timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=IMAGE, patch_size=PATCH, num_classes=CLASSES, mlp_ratio=2.0, **SIZE)


def hf_config(config_class, **extra):
    return config_class(
        image_size=IMAGE, patch_size=PATCH, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra,
    )


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(hf_config(ViTConfig, intermediate_size=64))


def hf_dinov2():
    from transformers import Dinov2Config, Dinov2ForImageClassification

    return Dinov2ForImageClassification(hf_config(Dinov2Config, mlp_ratio=2))


BACKBONES = {"examples": examples_vit, "timm": timm_vit, "hf": hf_vit, "dinov2": hf_dinov2}


class Model(L.LightningModule):
    def __init__(self, backbone: str) -> None:
        super().__init__()
        self.backbone = BACKBONES[backbone]()
        self.losses: list[float] = []
        self.seen: list[int] = []
        self.record_initial = False

    def on_train_start(self) -> None:
        self.restored = snapshot(self, self.trainer)  # after a resume: what the checkpoint restored
        self.initial = self.state_dict() if self.record_initial else None  # after setup, before the first step

    def forward(self, x):
        out = self.backbone(x)
        return out if isinstance(out, torch.Tensor) else out.logits

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.seen.extend(index.tolist())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def data(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH * STEPS
    images, labels = torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(images, labels, torch.arange(n)), batch_size=batch_size, shuffle=False)


# Activation checkpointing composed with the split blocks: full (the default), selective, none.
CHECKPOINTING = {"examples": True, "timm": "selective", "hf": False, "dinov2": True}


def fit(
    backbone: str, tp: int, steps: int = STEPS, ckpt: Path | None = None, precision: str = "32-true"
) -> tuple[dict, Model, L.Trainer]:
    torch.manual_seed(dist.get_rank() + 1 if dist.is_initialized() else 1)  # different weights on every rank
    model = Model(backbone)
    model.record_initial = backbone == "examples" and tp == 2 and precision == "32-true"
    L.seed_everything(0, verbose=False)
    ddp = "ddp_find_unused_parameters_true"  # DINOv2's mask token takes no part in classification
    checkpointing = CHECKPOINTING[backbone]
    strategy = ddp if tp == 0 else VitScaleStrategy(tensor_parallel=tp, activation_checkpointing=checkpointing)
    data_parallel = 4 if tp in (0, 1) else 4 // tp
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, gradient_clip_val=0.05, logger=False,
        precision=precision, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[ShardedEMA(0.5)] if model.record_initial or (backbone, tp) == EMA else [],
    )
    trainer.fit(model, data(GLOBAL_BATCH // data_parallel), ckpt_path=str(ckpt) if ckpt else None)
    state = measure_state_bytes(model, trainer.optimizers)
    facts = {"losses": model.losses, "seen": model.seen, "fraction": state.sharded_fraction}
    if tp:
        facts.update(block_fraction=_block_fraction(model, trainer), summary=trainer.strategy.plan.summary())
    return facts, model, trainer


SAVED: dict[Path, dict[str, torch.Tensor]] = {}
EMA = ("examples", 0)  # the DDP side of the full views' EMA check


def resumes(out: Path, backbone: str, saved_under: int, resumed_under: int, suffix: str = "") -> dict:
    """Resume the checkpoint saved after ``STEPS`` under ``saved_under`` ranks of tensor parallelism for one step
    under ``resumed_under``; what it restored against what was saved."""
    ckpt = out / f"{backbone}-{saved_under}{suffix}.ckpt"
    saved = SAVED[ckpt]
    try:
        _, resumed, trainer = fit(backbone, resumed_under, steps=STEPS + 1, ckpt=ckpt)
    except TensorLayoutError as error:
        return {"refused": str(error)}
    different = [k for k in saved if not torch.equal(saved[k], resumed.restored[k])]
    return {"keys": len(saved), "optimizer_keys": sum(k.startswith("o.") for k in saved), "different": different,
            "global_step": trainer.global_step}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def momentum(optimizer_state: dict) -> dict[str, torch.Tensor]:
    return {str(i): s["momentum_buffer"] for i, s in optimizer_state["state"].items()}


def full_views(out: Path, model: Model, trainer: L.Trainer, ddp: dict) -> dict:
    """The examples' ViT (packed qkv) after a TP=2 x FSDP=2 fit: every full view of its weights in the model's own
    layout. ``ddp``: the same fit under DDP (weights and momentum, close to these up to reduction order)."""
    torch.manual_seed(1)
    initial = Model("examples").state_dict()  # rank 0's weights, which every rank takes at setup
    state = model.state_dict()
    full = out / "examples-2-full.ckpt"
    trainer.strategy.state_dict_type = "full"
    trainer.save_checkpoint(full)
    trainer.strategy.state_dict_type = "sharded"
    saved = torch.load(full, weights_only=True)
    x = torch.randn(4, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    plain = Model("examples")
    plain.load_state_dict(saved["state_dict"], strict=True)  # as a DDP script loads it
    with torch.no_grad():
        outputs = (model.eval()(x), plain.eval()(x))
    facts = {
        "after_setup": max_difference(model.initial, initial),
        "state_vs_file": max_difference(state, saved["state_dict"]),
        "state_vs_ddp": max_difference(state, ddp["state"]), "layout_key": "vitscale_tensor_layout" in saved,
        "momentum_vs_ddp": max_difference(momentum(saved["optimizer_states"][0]), momentum(ddp["optimizer"])),
        "outputs": (outputs[0] - outputs[1]).abs().max().item(),
        "ema_vs_ddp": max_difference(saved["ema_state_dict"], ddp["ema"]),
    }
    shards = next(c for c in trainer.callbacks if isinstance(c, ShardedEMA)).shards
    ema = {k: full_tensor(v) for k, v in shards.state_dict().items()}
    shards.load_full(saved["ema_state_dict"])  # as a resume from the full file does
    facts["ema_round_trip"] = max_difference({k: full_tensor(v) for k, v in shards.state_dict().items()}, ema)
    if dist.get_rank() == 0:
        consolidated = load_consolidated(out / "examples-2.ckpt")
        facts["consolidated_vs_file"] = max_difference(consolidated["state_dict"], saved["state_dict"])
        facts["consolidated_momentum_vs_file"] = max_difference(
            momentum(consolidated["optimizer_states"][0]), momentum(saved["optimizer_states"][0])
        )
        facts["consolidated_ema_vs_file"] = max_difference(consolidated["ema_state_dict"], saved["ema_state_dict"])
    with torch.no_grad():  # a full state dict loads back into the split model (per-rank rows again)
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(state)
    facts["state_round_trip"] = max_difference(model.state_dict(), state)
    SAVED[full] = SAVED[out / "examples-2.ckpt"]  # the full file resumes as the sharded folder does
    return facts


def _block_fraction(model: Model, trainer: L.Trainer) -> float:
    """Parameter + optimizer bytes of the blocks' Linears on this rank / unsharded (gradients, freed after the
    step, take the parameters' layout)."""
    blocks = [model.get_submodule(name) for name in trainer.strategy.plan.block_names]
    params = [p for block in blocks for m in block.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()]
    state = trainer.optimizers[0].state
    tensors = [t for p in params for t in (p, state[p]["momentum_buffer"])]
    local = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in tensors)
    return local / sum(t.numel() for t in tensors)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    results = {}
    for backbone in BACKBONES:
        for tp in (0, 2, 4) if backbone == "examples" else (0, 2):
            results[f"{backbone}-{tp}"], model, trainer = fit(backbone, tp)
            if backbone == "examples" and tp == 0:
                ema = next(c for c in trainer.callbacks if isinstance(c, ShardedEMA)).shards.state_dict()
                ddp = {"state": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(), "ema": ema}
            if tp == 2 and backbone in ("examples", "hf"):  # saved for the resumes below
                trainer.save_checkpoint(out / f"{backbone}-{tp}.ckpt")
                SAVED[out / f"{backbone}-{tp}.ckpt"] = snapshot(model, trainer)
            if tp == 2 and backbone == "examples":
                results["full-views"] = full_views(out, model, trainer, ddp)
    for tp in (1, 2):  # bf16-mixed (O2, fp32 norms, the non-finite guard on): TP beside FSDP=4's recipe
        results[f"examples-{tp}-bf16"] = fit("examples", tp, precision="bf16-mixed")[0]
    results["resume-hf-2-to-1"] = resumes(out, "hf", 2, 1)
    results["resume-examples-2-to-2"] = resumes(out, "examples", 2, 2)
    results["resume-examples-2-to-1"] = resumes(out, "examples", 2, 1)
    results["resume-examples-2-full-to-2"] = resumes(out, "examples", 2, 2, suffix="-full")
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
