"""Detection models whose step branches on values (torchvision's random resize, box matching and NMS; HF's DETR
losses matching boxes with SciPy) under ``VitScaleStrategy()`` on 2 CPU ranks, against DDP: how the planner measured
the step (on real values, or the recipe's fallback), the units and checkpointing it chose, the setup seconds and the
median step seconds (steps 3 on), and each step's loss beside DDP's.

    PYTHONPATH=. python benchmarks/detection_plans.py OUT.json [--models fcos,hf_detr] [--batch 4 --steps 6
        --size 64 --no-ddp --precision bf16-mixed]

(Lightning starts the second rank itself.)

Random init, 64-pixel images with two boxes each (no downloads), fp32 (``--precision``: both runs' flag), SGD. Run
it on two trees (a ``git worktree`` of the commit before, ``PYTHONPATH`` pointing at it) for a before/after table;
``benchmarks/RESULTS.md`` has them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_vitscale import VitScaleStrategy

DDP = "ddp_find_unused_parameters_true"  # torchvision's detectors leave some heads unused in a step
CLASSES = 5


def torchvision_detector(name: str, size: int, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision.models.detection as detection

        return getattr(detection, name)(weights=None, weights_backbone=None, num_classes=CLASSES, min_size=size,
                                        max_size=size, **kwargs)

    return build


def hf_detector(kind: str, size: int) -> Callable[[], nn.Module]:
    """A small HF DETR-family model: a 4-stage ResNet backbone, 2 encoder and 2 decoder layers, 10 queries."""

    def build() -> nn.Module:
        import transformers as t

        backbone = dict(embedding_size=8, hidden_sizes=[16, 24, 32, 48], depths=[1, 1, 1, 1])
        heads = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=10,
                     num_labels=CLASSES, use_timm_backbone=False, use_pretrained_backbone=False)
        if kind == "hf_yolos":
            return t.YolosForObjectDetection(t.YolosConfig(
                image_size=[size, size], patch_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, num_detection_tokens=10, num_labels=CLASSES))
        if kind == "hf_deformable":
            config = t.DeformableDetrConfig(backbone_config=t.ResNetConfig(
                **backbone, out_features=["stage2", "stage3", "stage4"]), num_feature_levels=3, **heads)
            return t.DeformableDetrForObjectDetection(config)
        pairs = {"hf_detr": (t.DetrConfig, t.DetrForObjectDetection),
                 "hf_conditional": (t.ConditionalDetrConfig, t.ConditionalDetrForObjectDetection)}
        config_class, model_class = pairs[kind]
        return model_class(config_class(backbone_config=t.ResNetConfig(**backbone, out_features=["stage4"]), **heads))

    return build


def models(size: int) -> dict[str, Callable[[], nn.Module]]:
    return {
        "fcos": torchvision_detector("fcos_resnet50_fpn", size, trainable_backbone_layers=3),
        "retinanet": torchvision_detector("retinanet_resnet50_fpn", size, trainable_backbone_layers=3),
        "ssdlite": lambda: __import__("torchvision.models.detection", fromlist=["ssdlite320_mobilenet_v3_large"])
        .ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=CLASSES),
        "frcnn_mnv3": torchvision_detector("fasterrcnn_mobilenet_v3_large_320_fpn", size),
        "frcnn_r50": torchvision_detector("fasterrcnn_resnet50_fpn", size, trainable_backbone_layers=3),
        "maskrcnn": torchvision_detector("maskrcnn_resnet50_fpn", size, trainable_backbone_layers=3),
        "keypoint": torchvision_detector("keypointrcnn_resnet50_fpn", size, trainable_backbone_layers=3,
                                         num_keypoints=3),
        **{kind: hf_detector(kind, size) for kind in ("hf_detr", "hf_conditional", "hf_deformable", "hf_yolos")},
    }


class Boxes(Dataset):
    """``n`` random images of ``size`` pixels with two boxes each (masks, keypoints where the model needs them)."""

    def __init__(self, n: int, size: int, masks: bool = False, keypoints: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = []
        for _ in range(n):
            corner = torch.rand(2, 2, generator=generator) * (size / 2)
            extent = torch.rand(2, 2, generator=generator) * (size / 3) + 8
            boxes = torch.cat([corner, (corner + extent).clamp(max=size - 1)], 1)
            target = {"boxes": boxes, "labels": torch.randint(1, CLASSES, (2,), generator=generator)}
            if masks:
                target["masks"] = (torch.rand(2, size, size, generator=generator) > 0.5).to(torch.uint8)
            if keypoints:
                near = boxes[:, None, :2] + torch.rand(2, 3, 2, generator=generator) * 4
                target["keypoints"] = torch.cat([near, torch.ones(2, 3, 1)], -1)
            self.items.append((torch.rand(3, size, size, generator=generator), target))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.items[index]


def collate(samples: list) -> tuple[list, list]:
    return [image for image, _ in samples], [target for _, target in samples]


class Detection(L.LightningModule):
    """A detector's summed training losses (torchvision) or its ``loss`` (HF, boxes as normalised cx, cy, w, h)."""

    def __init__(self, name: str, build: Callable[[], nn.Module], size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hf, self.size, self.det = name.startswith("hf_"), size, build()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[list, list], batch_idx: int) -> torch.Tensor:
        images, targets = batch
        if self.hf:
            labels = [{"class_labels": t["labels"], "boxes": self._centred(t["boxes"])} for t in targets]
            loss = self.det(pixel_values=torch.stack(images), labels=labels).loss
        else:
            loss = sum(self.det(images, targets).values())
        self.losses.append(loss.item())
        return loss

    def _centred(self, boxes: torch.Tensor) -> torch.Tensor:
        b = boxes / self.size
        return torch.stack([(b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2, b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01, momentum=0.9)


class Stamps(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *_: Any) -> None:
        self.times.append(time.perf_counter())

    def on_train_end(self, *_: Any) -> None:
        self.times.append(time.perf_counter())


def fit(name: str, strategy: Any, args: argparse.Namespace) -> dict[str, Any]:
    module, stamps = Detection(name, models(args.size)[name], args.size), Stamps()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        precision=args.precision, callbacks=[stamps], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    data = Boxes(args.batch * 2 * args.steps, args.size, masks=name == "maskrcnn", keypoints=name == "keypoint")
    started = time.perf_counter()
    try:
        trainer.fit(module, DataLoader(data, batch_size=args.batch, collate_fn=collate))
    except Exception as error:  # noqa: BLE001 - a failing model is a row of the table
        return {"error": f"{type(error).__name__}: {error}"[:1500], "traceback": traceback.format_exc()[-3000:]}
    steps = [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    out = {"losses": module.losses, "setup_s": stamps.times[0] - started, "step_s": statistics.median(steps[2:])}
    if strategy != DDP:
        out["summary"] = trainer.strategy.plan.summary()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--models", default=",".join(models(64)))
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--no-ddp", action="store_true")
    parser.add_argument("--precision", default="32-true", help="Trainer(precision=...) of both runs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = {}
    for name in args.models.split(","):
        results[name] = {"default": fit(name, VitScaleStrategy(), args)}
        if not args.no_ddp:
            results[name]["ddp"] = fit(name, DDP, args)
    if rank_zero_only.rank == 0:
        versions = {"torch": torch.__version__, "lightning": L.__version__}
        with open(args.out, "w") as file:
            json.dump({"args": vars(args), "versions": versions, "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
