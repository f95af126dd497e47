"""Setup time through ``Trainer.fit`` on one CPU device: from the ``fit`` call to Lightning's first
``on_train_batch_start``, ``VitScaleStrategy()`` as a drop-in user writes it (no ``example_input_array``: the planner
measures the train loader's first batch) against ``strategy="ddp"``. The default's planner is most of the
difference: it runs the step on fake tensors (and, for detectors, on real values).

Usage::

    python benchmarks/default_setup_time.py                       # five backbones, 3 rounds
    python benchmarks/default_setup_time.py --models swin --rounds 1 --json out.json
    python benchmarks/default_setup_time.py --models detector --memory-budget 314572800   # a budget that needs AC

Models (``bf16-mixed``, AdamW, random data): ``vit`` timm's ``vit_small_patch16_224``, ``swin`` timm's
``swin_tiny_patch4_window7_224`` and ``convnext`` timm's ``convnext_tiny`` at 224 px, batch 8; ``resnet``
torchvision's ResNet-50 at 64 px, batch 8; ``detector`` torchvision's ``fasterrcnn_mobilenet_v3_large_320_fpn`` at
64 px, batch 4 (its step runs on real values: fake tensors cannot follow it). Each round runs every (model,
variant) in a process of its own, the variants' order rotating between rounds: a first fit there (cold: a user's
run, paying torch's first-call costs) and a second (warm); each fit ends at its first batch (the module's
``on_train_batch_start`` returns -1: no step runs); the median over rounds of each. Run
the same script from another checkout (copied into it) to compare commits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.default_fit_speed import Classifier  # noqa: E402 - after the checkout is importable
from lightning_vitscale import VitScaleStrategy  # noqa: E402
from tests.helpers.models import boxes  # noqa: E402

MODELS = ("vit", "swin", "convnext", "resnet", "detector")
VARIANTS = ("ddp", "VitScaleStrategy()")
DETECTOR_SIZE = 64


def backbone(name: str) -> tuple[nn.Module, int, int]:
    """The network, its image size and batch."""
    if name == "resnet":
        import torchvision

        return torchvision.models.resnet50(num_classes=10), 64, 8
    if name == "detector":
        import torchvision

        return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=3, min_size=DETECTOR_SIZE,
            max_size=DETECTOR_SIZE), DETECTOR_SIZE, 4
    import timm

    timm_name = {"vit": "vit_small_patch16_224", "swin": "swin_tiny_patch4_window7_224", "convnext": "convnext_tiny"}
    return timm.create_model(timm_name[name], num_classes=10), 224, 8


class SetupOnly(Classifier):
    """``default_fit_speed``'s classifier, ending each epoch at its first batch (no step runs: setup alone)."""

    setup_done_at: float | None = None

    def on_train_batch_start(self, batch, batch_idx) -> int:
        self.setup_done_at = time.perf_counter()
        return -1


class Detector(SetupOnly):
    def training_step(self, batch, batch_idx):
        images, targets = batch
        return sum(self.net(images, targets).values())


def data(name: str, size: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    if name != "detector":
        samples = [(torch.randn(3, size, size, generator=g), int(torch.randint(0, 10, (), generator=g)))
                   for _ in range(batch)]
        return DataLoader(samples, batch_size=batch)
    samples = boxes(batch, size)
    return DataLoader(samples, batch_size=batch, collate_fn=lambda s: ([i for i, _ in s], [t for _, t in s]))


def setup_seconds(model_name: str, variant: str, budget: int | None = None) -> float:
    torch.manual_seed(0)
    net, size, batch = backbone(model_name)
    module = (Detector if model_name == "detector" else SetupOnly)(net)
    strategy = "ddp" if variant == "ddp" else VitScaleStrategy(memory_budget=budget)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(module, data(model_name, size, batch))
    assert module.setup_done_at is not None
    return module.setup_done_at - start


def in_fresh_process(model_name: str, variant: str, budget: int | None) -> tuple[float, float]:
    """The fit in a process of its own (a user's run: the first planning in a process pays torch's first-call
    costs), then again in that process (warm)."""
    budget_flag = [] if budget is None else ["--memory-budget", str(budget)]
    out = subprocess.run([sys.executable, __file__, "--child", model_name, variant, *budget_flag], capture_output=True,
                         text=True, check=True)
    cold, warm = json.loads(out.stdout.strip().splitlines()[-1])
    return cold, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--memory-budget", type=int, help="VitScaleStrategy(memory_budget=BYTES): one that needs"
                        " checkpointing measures the step twice (unchecked first)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps([setup_seconds(*args.child, args.memory_budget) for _ in range(2)]))
        return
    seconds: dict[str, dict[str, dict[str, list[float]]]] = {
        m: {v: {"cold": [], "warm": []} for v in VARIANTS} for m in args.models}
    for round_index in range(args.rounds):
        order = VARIANTS[round_index % len(VARIANTS):] + VARIANTS[:round_index % len(VARIANTS)]
        for model_name in args.models:
            for variant in order:
                cold, warm = in_fresh_process(model_name, variant, args.memory_budget)
                seconds[model_name][variant]["cold"].append(cold)
                seconds[model_name][variant]["warm"].append(warm)
                print(f"round {round_index} {model_name} {variant}: {cold:.2f} s, then {warm:.2f} s", flush=True)
    print("| model | " + " | ".join(f"{v} cold | {v} warm" for v in VARIANTS) + " |")
    print("|---|" + "---|---|" * len(VARIANTS))
    for model_name, by_variant in seconds.items():
        print(f"| {model_name} | " + " | ".join(
            f"{statistics.median(by_variant[v]['cold']):.2f} s | {statistics.median(by_variant[v]['warm']):.2f} s"
            for v in VARIANTS) + " |")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "lightning": L.__version__,
                                         "rounds": args.rounds, "memory_budget": args.memory_budget,
                                         "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
