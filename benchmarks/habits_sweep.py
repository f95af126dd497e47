"""DDP habits, tried: what users do to a model, an optimizer, the callbacks and the Trainer under ``strategy="ddp"``,
each trained 3 steps under DDP and under ``VitScaleStrategy()`` (and the recipe's ``priority="memory"``) on 2 CPU
ranks from the same weights and data. Per case: each run's losses (averaged over the ranks), the largest relative
difference to DDP's, or the error (its type and first line): a refusal at setup is an outcome, a failure after it
is a defect.

Usage (ranks started by torch's launcher; ~3 min for the 45 cases on 2 cores)::

    python -m torch.distributed.run --nproc-per-node=2 benchmarks/habits_sweep.py --json habits.json
    python -m torch.distributed.run --nproc-per-node=2 benchmarks/habits_sweep.py --only optimizer/
    python -m torch.distributed.run --nproc-per-node=2 benchmarks/habits_sweep.py --precision bf16-mixed

``benchmarks/backbone_sweep.py`` tries published architectures as they come; this tries what users change on them.
The defects it found were fixed with a test each (``CHANGELOG.md``, 2026-12-04); ``backbone_finetuning`` differs
from DDP on purpose: DDP never averages the gradients of a backbone unfrozen during ``fit`` (its reducer keeps the
parameters that required grad when it was built), the strategy trains it as DDP does on one device.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import callbacks as cb
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from tests.helpers.zoo import CLASSES, Block, PatchClassifier

IMAGE = 16


def timm_vit(**options) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**{"img_size": IMAGE, "patch_size": 4, "embed_dim": 32, "depth": 3, "num_heads": 4,
                                "mlp_ratio": 2, "num_classes": CLASSES, **options})


def frozen(model: nn.Module, trained: Callable[[nn.Module], list[nn.Module]]) -> nn.Module:
    model.requires_grad_(False)
    for part in trained(model):
        part.requires_grad_(True)
    return model


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.up = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.down), self.up)


def lora() -> nn.Module:
    model = frozen(timm_vit(), lambda m: [m.head])
    for block in model.blocks:
        block.attn.qkv = LoRA(block.attn.qkv)
    return model


class Blocks(PatchClassifier):
    """The zoo's hand-written frame with its blocks held as ``layout`` says."""

    def __init__(self, layout: str) -> None:
        blocks = [Block(32, nn.Identity()) for _ in range(4)]
        held: nn.Module = nn.ModuleList(blocks)
        if layout == "dict":
            held = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        elif layout == "nested":
            held = nn.ModuleList([nn.ModuleList(blocks[:2]), nn.ModuleList(blocks[2:])])
        elif layout == "shared_module":
            blocks[2].fc1 = blocks[0].fc1
        elif layout == "weight_norm":
            for b in blocks:
                torch.nn.utils.parametrizations.weight_norm(b.fc1)
        super().__init__(32, nn.Identity() if layout == "attributes" else held)
        if layout == "attributes":
            for i, b in enumerate(blocks):
                setattr(self, f"block{i}", b)
        self.order = blocks
        if layout == "lazy_head":
            self.head = nn.LazyLinear(CLASSES)
        if layout == "scalar_temperature":
            self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images).flatten(2).transpose(1, 2)
        for block in self.order:
            x = block(x)
        out = self.head(self.norm(x).mean(1))
        return out * self.temperature if hasattr(self, "temperature") else out


def hf(config: str, model: str, checkpointing: bool = False, **options) -> nn.Module:
    import transformers

    made = getattr(transformers, model)(getattr(transformers, config)(image_size=IMAGE, num_labels=CLASSES, **options))
    if checkpointing:
        made.gradient_checkpointing_enable()
    return _Logits(made)


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=x)
        return out if isinstance(out, torch.Tensor) else out.logits


def _timm(module: str, name: str, **options) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import importlib

        return getattr(importlib.import_module(f"timm.models.{module}"), name)(num_classes=CLASSES, **options)

    return make


def _grad_checkpointed() -> nn.Module:
    model = timm_vit()
    model.set_grad_checkpointing(True)
    return model


_HF_VIT = dict(patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
MODELS: dict[str, Callable[[], nn.Module]] = {
    "timm_vit": timm_vit,
    "frozen_first_blocks": lambda: frozen(timm_vit(), lambda m: [m.blocks[2], m.norm, m.head]),
    "linear_probe": lambda: frozen(timm_vit(), lambda m: [m.head]),
    "lora_adapters": lora,
    "timm_set_grad_checkpointing": _grad_checkpointed,
    "hf_gradient_checkpointing_enable": lambda: hf("ViTConfig", "ViTForImageClassification", True, **_HF_VIT),
    "timm_eva_rope_swiglu": _timm("eva", "Eva", img_size=IMAGE, patch_size=4, embed_dim=32, depth=2, num_heads=4,
                                  use_rot_pos_emb=True, ref_feat_shape=(4, 4), swiglu_mlp=True, init_values=0.1),
    "hf_dinov2": lambda: hf("Dinov2Config", "Dinov2ForImageClassification", patch_size=4, hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2),
    "timm_registers_no_cls_token": lambda: timm_vit(reg_tokens=4, class_token=False, global_pool="avg",
                                                    no_embed_class=True, dynamic_img_size=True),
    "timm_drop_path": lambda: timm_vit(drop_path_rate=0.3, drop_rate=0.1, proj_drop_rate=0.1),
    "timm_mlp_mixer": _timm("mlp_mixer", "MlpMixer", img_size=IMAGE, patch_size=4, num_blocks=2, embed_dim=32),
    "timm_convnext": _timm("convnext", "ConvNeXt", depths=(1, 1, 2, 1), dims=(8, 16, 16, 32), kernel_sizes=3,
                           patch_size=1),
    "blocks_as_attributes": lambda: Blocks("attributes"),
    "blocks_in_moduledict": lambda: Blocks("dict"),
    "blocks_in_nested_lists": lambda: Blocks("nested"),
    "module_shared_by_blocks": lambda: Blocks("shared_module"),
    "weight_norm_parametrization": lambda: Blocks("weight_norm"),
    "lazy_head": lambda: Blocks("lazy_head"),
    "scalar_temperature": lambda: Blocks("scalar_temperature"),
}


def _timm_optimizer(name: str, **options) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params) -> torch.optim.Optimizer:
        import timm.optim

        return getattr(timm.optim, name)(params, **options)

    return make


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "timm_lamb": _timm_optimizer("Lamb", lr=1e-2),
    "timm_lars": _timm_optimizer("Lars", lr=0.1),
    "timm_lion": _timm_optimizer("Lion", lr=1e-3),
    "timm_adan": _timm_optimizer("Adan", lr=1e-3),
    "timm_adafactor": _timm_optimizer("Adafactor", lr=1e-2),
    "torch_adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "torch_muon": lambda params: torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02),
    "torch_rprop": lambda params: torch.optim.Rprop(params, lr=1e-3),
}


@dataclass
class Case:
    model: str = "timm_vit"
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda params: torch.optim.AdamW(params, lr=1e-2)
    callbacks: Callable[[], list[cb.Callback]] = list
    trainer: dict[str, Any] = field(default_factory=dict)
    memory: bool = True  # also the recipe's priority="memory"
    lightning_grad_norm: bool = False  # on_before_optimizer_step logs Lightning's grad_norm


def _backbone_finetuning() -> list[cb.Callback]:
    return [cb.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)]


_EPOCHS = dict(max_epochs=3, limit_train_batches=2, max_steps=-1)
CASES: dict[str, Case] = {
    **{f"model/{name}": Case(model=name) for name in MODELS},
    **{f"optimizer/{name}": Case(optimizer=make, memory=False) for name, make in OPTIMIZERS.items()},
    "callback/backbone_finetuning": Case(model="backbone_and_head", callbacks=_backbone_finetuning, trainer=_EPOCHS),
    "callback/gradient_accumulation_scheduler": Case(
        callbacks=lambda: [cb.GradientAccumulationScheduler({0: 1, 1: 2})], trainer=_EPOCHS),
    "callback/model_pruning": Case(callbacks=lambda: [cb.ModelPruning("l1_unstructured", amount=0.3)],
                                   trainer=_EPOCHS, memory=False),
    "trainer/clip_value": Case(trainer=dict(gradient_clip_val=0.05, gradient_clip_algorithm="value"), memory=False),
    "trainer/clip_norm": Case(trainer=dict(gradient_clip_val=0.5), memory=False),
    "trainer/detect_anomaly": Case(trainer=dict(detect_anomaly=True), memory=False),
    "trainer/deterministic": Case(trainer=dict(deterministic=True), memory=False),
    "trainer/profiler_simple": Case(trainer=dict(profiler="simple"), memory=False),
    "trainer/overfit_batches": Case(trainer=dict(overfit_batches=2), memory=False),
    "step/lightning_grad_norm": Case(lightning_grad_norm=True, memory=False),
}


class Module(L.LightningModule):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case, self.losses = case, []
        torch.manual_seed(0)  # every strategy's run starts from the same weights
        if case.model == "backbone_and_head":
            self.backbone, self.head = timm_vit(num_classes=0), nn.Linear(32, CLASSES)
        else:
            self.backbone, self.head = MODELS[case.model](), nn.Identity()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.case.lightning_grad_norm:
            from lightning.pytorch.utilities import grad_norm

            self.log_dict(grad_norm(self.backbone, norm_type=2))

    def configure_optimizers(self):
        return self.case.optimizer([p for p in self.parameters() if p.requires_grad])


PRECISION = "32-true"  # --precision


def fit(case: Case, strategy) -> list[float]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (64,), generator=g))
    options = {"max_steps": 3, **case.trainer}
    model = Module(case)
    L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, logger=False,
              precision=PRECISION,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=case.callbacks(), **options).fit(model, DataLoader(data, batch_size=4))
    losses = torch.tensor(model.losses)
    torch.distributed.all_reduce(losses)
    return (losses / torch.distributed.get_world_size()).tolist()


def run(case: Case) -> dict:
    strategies = {"ddp": lambda: "ddp_find_unused_parameters_true", "default": VitScaleStrategy,
                  **({"memory": lambda: VitScaleStrategy(priority="memory")} if case.memory else {})}
    row: dict[str, Any] = {}
    for name, make in strategies.items():
        try:
            row[name] = fit(case, make())
        except Exception as error:  # noqa: BLE001 - an outcome this sweep records
            said = (str(error).splitlines() or [""])[0][:240]
            row[name] = f"{type(error).__name__}: {said}"
            logging.debug(traceback.format_exc())
    ddp = row["ddp"]
    for name in strategies:
        if name != "ddp" and isinstance(row[name], list) and isinstance(ddp, list) and len(ddp) == len(row[name]):
            row[f"{name}_vs_ddp"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row[name], ddp))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="cases whose name starts with this (repeatable)")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    parser.add_argument("--precision", default="32-true", help="bf16-mixed: DDP's AMP O1 against the recipe's O2")
    args = parser.parse_args()
    global PRECISION
    PRECISION = args.precision
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = {name: run(case) for name, case in CASES.items()
            if not args.only or any(name.startswith(prefix) for prefix in args.only)}
    if int(os.environ.get("RANK", 0)) == 0:
        for name, row in rows.items():
            cells = [f"{key} {value:.2g}" if isinstance(value, float) else f"{key}: {value}" if isinstance(value, str)
                     else "" for key, value in row.items()]
            print(f"{name:50s} " + " | ".join(c for c in cells if c))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "lightning": L.__version__, "precision": PRECISION,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
