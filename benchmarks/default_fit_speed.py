"""Step time through ``Trainer.fit`` on CPU ranks: DDP against ``VitScaleStrategy()`` with no argument (the
planner's speed-first plan) and against the recipe's memory-first plan one argument away
(``VitScaleStrategy(priority="memory")``: every block checkpointed, its own unit, resharded), no
``example_input_array``: what a drop-in user gets (issues 33 and 47).

Usage::

    python benchmarks/default_fit_speed.py                          # the three models, 3 rounds
    python benchmarks/default_fit_speed.py --models mha --rounds 5 --json out.json
    python benchmarks/default_fit_speed.py --streamed                # no batch at setup: units from the collectives
    python benchmarks/default_fit_speed.py --two-pass                # a backbone run on two crop sizes a step
    python benchmarks/default_fit_speed.py --manual                  # manual optimization, no forward

Models (fp32, AdamW, batch 8 per rank, 32 px, patch 4: 64 tokens): ``vit`` the demo ViT (dim 256, 6 blocks, the
benchmark's own), ``timm`` timm's ``vit_tiny_patch16_224`` at 32 px, ``mha`` a hand-written ViT whose blocks are
built on ``nn.MultiheadAttention`` (dim 256, 6 blocks); ``--two-pass``: ``timm2``, timm's model run on the images
and on 16 px crops of them each step (DINO's multi-crop), the default against itself sending a zero reduce-scatter
after every later call of a unit, as before 5b46358 (``sharding/deferred_reduction.py`` patched out); ``--manual``:
``manual``, the ``mha`` model under manual optimization without ``forward`` (its step logs the optimizer's learning
rate), the default against itself with its step unmeasured, as before ``memory/step_stand_ins.py`` (every block
checkpointed: the planner's twin got no optimizer). One launch
(torch's elastic launcher, gloo, one thread per rank) runs, per model and round, one ``Trainer.fit`` per variant
(the order rotating between rounds, so a drifting machine charges every variant alike); each fit's steps after
``--warmup`` are timed from Lightning's ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
optimizer step). Median over every round's timed steps, slowest rank.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_vitscale.cli.demo import TinyViT  # noqa: E402 - after the checkout is importable

MODELS = ("vit", "timm", "mha")
VARIANTS = ("ddp", "VitScaleStrategy()", 'VitScaleStrategy(priority="memory")')
# --streamed: the training data a plain iterable (setup reads no batch), and the default against a unit per block,
# what it made there before 5f74f1b (the first step's plan still chooses checkpointing and units kept gathered).
STREAMED_VARIANTS = ("ddp", "VitScaleStrategy()", "VitScaleStrategy(blocks_per_unit=1)")
TWO_PASS_VARIANTS = ("ddp", "VitScaleStrategy()", "VitScaleStrategy(), zeros after every call (before 5b46358)")
MANUAL_VARIANTS = ("ddp", "VitScaleStrategy()", "VitScaleStrategy(), its step unmeasured (before)")


class MhaBlock(nn.Module):
    """A pre-norm ViT block on ``nn.MultiheadAttention`` (packed in-projection): the held-out block family."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MhaViT(nn.Module):
    def __init__(self, dim: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, 4)
        self.pos = nn.Parameter(torch.randn(1, 64, dim) * 0.02)
        self.blocks = nn.ModuleList(MhaBlock(dim, 8) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class Classifier(L.LightningModule):
    """``net`` with cross-entropy and AdamW; no ``example_input_array``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TwoCrops(nn.Module):
    """The backbone on the images, then on their central 16 px crops: every block runs twice a step."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.net(x[..., 8:24, 8:24])


class ManualClassifier(L.LightningModule):
    """``net`` under manual optimization, no ``forward``: the step logs the learning rate its optimizer holds."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(self.net(x), y))
        optimizer.step()
        self.log("lr", optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_module(name: str) -> L.LightningModule:
    if name == "manual":
        return ManualClassifier(MhaViT())
    if name == "timm2":
        import timm

        return Classifier(TwoCrops(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                                     patch_size=4, num_classes=10, dynamic_img_size=True)))
    if name == "vit":
        return TinyViT(image=32, patch=4, dim=256, depth=6)
    if name == "timm":
        import timm

        return Classifier(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                                            num_classes=10))
    return Classifier(MhaViT())


def fit_times(model_name: str, variant: str, steps: int, warmup: int, streamed: bool = False) -> list[float]:
    """One ``Trainer.fit`` of ``warmup + steps`` steps; the timed steps' seconds on this rank."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_vitscale import VitScaleStrategy
    from tests.helpers.models import Streamed

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    from lightning_vitscale.sharding import steps as sharding_steps

    planning_batch = importlib.import_module("lightning_vitscale.memory.planning_batch")  # the package's function

    strategy = {"ddp": lambda: "ddp", VARIANTS[1]: lambda: VitScaleStrategy(),
                VARIANTS[2]: lambda: VitScaleStrategy(priority="memory"),
                STREAMED_VARIANTS[2]: lambda: VitScaleStrategy(blocks_per_unit=1),
                TWO_PASS_VARIANTS[2]: lambda: VitScaleStrategy(),
                MANUAL_VARIANTS[2]: lambda: VitScaleStrategy()}[variant]()
    deferral, stand_ins = sharding_steps.DeferredReduction, planning_batch.stand_ins
    if variant == TWO_PASS_VARIANTS[2]:  # setup installs nothing: every later call's post-backward sends zeros
        sharding_steps.DeferredReduction = lambda *args: None  # type: ignore[assignment,misc]
    if variant == MANUAL_VARIANTS[2]:  # the twin's self.optimizers() is [] again: its step cannot run
        planning_batch.stand_ins = lambda *args: {}
    L.seed_everything(0, verbose=False)
    module = make_module(model_name)
    n = 8 * (steps + warmup) * 2  # one epoch: batch 8 on each of 2 ranks
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps + warmup,
                        callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    loader = DataLoader(data, batch_size=8)
    try:
        trainer.fit(module, Streamed(loader) if streamed else loader)
    finally:
        sharding_steps.DeferredReduction = deferral  # type: ignore[misc]
        planning_batch.stand_ins = stand_ins
    summary = getattr(trainer.strategy, "plan", None)
    if summary is not None and trainer.global_rank == 0:
        print(f"{model_name} / {variant}:\n{summary.summary()}", flush=True)
    return timer.seconds[warmup:]


def variants_for(streamed: bool, two_pass: bool, manual: bool = False) -> tuple[str, ...]:
    return (STREAMED_VARIANTS if streamed else TWO_PASS_VARIANTS if two_pass else MANUAL_VARIANTS if manual
            else VARIANTS)


def worker(out: str, models: list[str], rounds: int, steps: int, warmup: int, streamed: bool = False,
           two_pass: bool = False) -> None:
    import os

    torch.set_num_threads(1)
    variants = variants_for(streamed, two_pass, manual=models == ["manual"])
    times: dict[str, dict[str, list[float]]] = {m: {v: [] for v in variants} for m in models}
    for model_name in models:
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                times[model_name][variant] += fit_times(model_name, variant, steps, warmup, streamed)
    result = {m: {v: 1e3 * statistics.median(t) for v, t in per.items()} for m, per in times.items()}
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", choices=[*MODELS, "timm2", "manual"], default=None,
                        help="default: the three models (timm2 with --two-pass, manual with --manual)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each fit")
    parser.add_argument("--json", help="also write the merged numbers here")
    parser.add_argument("--streamed", action="store_true",
                        help="data as a plain iterable (no batch at setup); the default against a unit per block")
    parser.add_argument("--two-pass", action="store_true",
                        help="timm2 (a backbone run twice a step): the default against zeros after every call")
    parser.add_argument("--manual", action="store_true",
                        help="manual (manual optimization, no forward): the default against its step unmeasured")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.models = ["manual"] if args.manual else args.models or (["timm2"] if args.two_pass else list(MODELS))
    if args.worker:
        worker(args.worker, args.models, args.rounds, args.steps, args.warmup, args.streamed, args.two_pass)
        return
    variants = variants_for(args.streamed, args.two_pass, args.manual)
    from tests.helpers.launch import assert_ok, torchrun

    with tempfile.TemporaryDirectory() as out:
        result = torchrun(Path(__file__), "--worker", out, "--models", *args.models, "--rounds", str(args.rounds),
                          "--steps", str(args.steps), "--warmup", str(args.warmup),
                          *(["--streamed"] if args.streamed else []), *(["--two-pass"] if args.two_pass else []),
                          nprocs=2, timeout=1800)
        assert_ok(result)
        print("\n".join(line for line in result.output.splitlines() if not line.startswith("[rank")))
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    merged = {m: {v: max(r[m][v] for r in ranks) for v in variants} for m in args.models}
    print("| model | " + " | ".join(f"{v}: ms/step | / DDP" for v in variants) + " |")
    print("|---|" + "---|---|" * len(variants))
    for m, per in merged.items():
        cells = " | ".join(f"{per[v]:.1f} | {per[v] / per['ddp']:.2f}x" for v in variants)
        print(f"| {m} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    main()
