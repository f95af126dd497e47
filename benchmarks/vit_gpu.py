"""ViT-B/16, ViT-L/16, ViT-H/14 at 224 px on one GPU: Lightning DDP eager vs VitScaleStrategy eager vs full recipe.

Usage::

    python benchmarks/vit_gpu.py                       # all models x configs, each at its best batch size
    python benchmarks/vit_gpu.py --models vit_b16 --batch-sizes 64 128
    python benchmarks/vit_gpu.py --search-largest      # largest ViT (from ViT-H up) that trains on this GPU
    python benchmarks/vit_gpu.py --dry-run             # the whole pipeline, tiny ViT, CPU, 2 steps

Configs (all ``precision="bf16-mixed"``, one synthetic batch made on the device and reused, AdamW):
  ddp    Lightning ``strategy="ddp"``, ``devices=1`` (world size 1: DDP's all-reduce is a local no-op, so this
         is plain autocast "O1" training with Lightning's usual wrapper — the baseline users start from).
  eager  ``VitScaleStrategy(kernels="eager")``: FSDP2 units per block, activation checkpointing, O2, fp32 norms.
  auto   ``VitScaleStrategy(kernels="auto")``: the same plus per-block torch.compile, fused AdamW, and xformers
         attention where the extra is installed and times faster than SDPA on the model's shapes.

Each (model, config, batch size) runs in a fresh subprocess, so an out-of-memory error cannot poison the next
trial. The batch size doubles until CUDA runs out of memory; the best images/s is kept. Images/s and MFU
come from ``lightning_vitscale.throughput.ThroughputMonitor`` (model FLOPs = 3 x forward, dense bf16 peak).
Outputs: ``vit_gpu.json``, a Markdown table appended to ``RESULTS.md``, a bar chart ``vit_gpu.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = ("ddp", "eager", "auto")
# name: timm model name plus keyword overrides (timm.create_model(name, pretrained=False, **overrides)).
MODELS: dict[str, dict] = {
    "vit_b16": dict(timm="vit_base_patch16_224"),
    "vit_l16": dict(timm="vit_large_patch16_224"),
    "vit_h14": dict(timm="vit_huge_patch14_224"),
}
_H = "vit_huge_patch14_224"
# --search-largest: ViT-H, then ViT-g, ViT-G, then wider/deeper, in increasing parameter count.
LADDER: list[tuple[str, dict]] = [
    ("ViT-H/14 (0.63B)", dict(timm=_H)),
    ("ViT-g/14 (1.0B)", dict(timm=_H, embed_dim=1408, depth=40, mlp_ratio=48 / 11)),
    ("ViT-G/14 (1.8B)", dict(timm=_H, embed_dim=1664, depth=48, mlp_ratio=64 / 13)),
    ("ViT-3B/14", dict(timm=_H, embed_dim=2048, depth=64)),
    ("ViT-e/14 (3.9B)", dict(timm=_H, embed_dim=1792, depth=56, mlp_ratio=15360 / 1792)),
    ("ViT-5B/14", dict(timm=_H, embed_dim=2560, depth=64, num_heads=20)),
    ("ViT-7B/14", dict(timm=_H, embed_dim=3072, depth=64, num_heads=24)),
    ("ViT-10B/14", dict(timm=_H, embed_dim=3584, depth=64, num_heads=28)),
]
_DRY = dict(timm="vit_base_patch16_224", img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
DRY_MODELS = {"vit_dry": _DRY}
DRY_LADDER = [("dry-1", _DRY), ("dry-2", dict(_DRY, embed_dim=96, depth=3))]


# --- one trial, in its own process ------------------------------------------------------------------------


def make_strategy(config: str, dry_run: bool):
    from lightning_vitscale import VitScaleStrategy

    match config:
        case "ddp":
            return "ddp"
        case "eager" | "auto":
            return VitScaleStrategy(kernels=config)
        case _:
            raise ValueError(f"config {config!r} is not one of {CONFIGS}")


def trial(spec: dict) -> dict:
    """Train ``warmup + steps`` batches; return images/s, TFLOP/s, MFU and peak memory of the measured window."""
    import lightning as L
    import timm
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_vitscale.throughput import ThroughputMonitor

    warnings.filterwarnings("ignore")
    device = torch.device("cpu" if spec["dry_run"] else "cuda")
    kwargs = dict(spec["model"])
    name = kwargs.pop("timm")
    image, classes = kwargs.pop("img_size", 224), kwargs.pop("num_classes", 1000)

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with device:  # build on the device: a multi-billion-parameter ViT initialises in seconds there
                self.backbone = timm.create_model(
                    name, pretrained=False, img_size=image, num_classes=classes, **kwargs
                )

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return F.cross_entropy(self.backbone(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.05)

    model = Classifier()
    params = sum(p.numel() for p in model.parameters())
    batch, steps, warmup = spec["batch"], spec["steps"], spec["warmup"]
    monitor = ThroughputMonitor(log_every_n_steps=steps, warmup_steps=warmup)
    trainer = L.Trainer(
        accelerator=device.type, devices=1, strategy=make_strategy(spec["config"], spec["dry_run"]),
        precision="bf16-mixed", max_steps=warmup + steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
    )
    class SameBatch(IterableDataset):
        """One synthetic batch made on the device, yielded every step: no host work, no transfer. It goes through
        the batch (not made inside the step) so the precision plugin casts it, as it does real data."""

        def __iter__(self):
            images = torch.randn(batch, 3, image, image, device=device)
            labels = torch.randint(0, classes, (batch,), device=device)
            return iter([(images, labels)] * (warmup + steps))

    start = time.perf_counter()
    try:
        trainer.fit(model, DataLoader(SameBatch(), batch_size=None))
    except torch.cuda.OutOfMemoryError:
        return {"oom": True}
    m = monitor.metrics
    plan = getattr(trainer.strategy, "plan", None)
    return {
        "oom": False,
        "attention": plan.kernels.get("attention") if plan is not None else "sdpa (autocast)",
        "params": params,
        "images_per_sec": m["throughput/samples_per_sec"],
        "tflops_per_sec": m.get("throughput/tflops_per_sec"),
        "mfu": m.get("throughput/mfu"),
        "peak_memory_gib": m.get("memory/peak_allocated_gib", m.get("memory/peak_rss_gib")),
        "fit_s": time.perf_counter() - start,
    }


def run_trial(spec: dict, timeout: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", MASTER_PORT=str(port))
    cmd = [sys.executable, str(Path(__file__)), "--trial", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"oom": False, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        out = proc.stdout + proc.stderr
        return {"oom": "OutOfMemoryError" in out, "error": f"exit {proc.returncode}: {out[-1500:]}"}
    return json.loads(lines[-1][len("RESULT ") :])


# --- searches -------------------------------------------------------------------------------------------------


def best_batch(name: str, model: dict, config: str, args: argparse.Namespace) -> dict:
    """Double the batch until out of memory (or --batch-sizes run out); keep the fastest."""
    sizes = args.batch_sizes or [args.start_batch * 2**i for i in range(20)]
    best: dict = {}
    for batch in sizes:
        spec = dict(model=model, config=config, batch=batch, steps=args.steps, warmup=args.warmup, dry_run=args.dry_run)
        result = run_trial(spec, args.timeout)
        print(f"{name:10s} {config:6s} batch {batch:5d}: {_short(result)}", flush=True)
        if result.get("error") and not result["oom"]:
            raise RuntimeError(f"{name} {config} batch {batch} failed:\n{result['error']}")
        if result["oom"]:
            break
        if result["images_per_sec"] > best.get("images_per_sec", 0):
            best = dict(result, batch=batch)
        if batch >= args.max_batch:
            break
    return dict(best or {"oom": True}, model=name, config=config)


def search_largest(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, model in DRY_LADDER if args.dry_run else LADDER:
        spec = dict(model=model, config="auto", batch=args.largest_batch, steps=1, warmup=2, dry_run=args.dry_run)
        result = run_trial(spec, args.timeout)
        print(f"{name:18s} batch {args.largest_batch}: {_short(result)}", flush=True)
        rows.append(dict(result, model=name, config="auto", batch=args.largest_batch))
        if result["oom"] or result.get("error"):
            break
    return rows


def _short(r: dict) -> str:
    if r.get("oom"):
        return "out of memory"
    if r.get("error"):
        return r["error"].splitlines()[0]
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return f"{r['images_per_sec']:.1f} img/s, MFU {mfu}, peak {r['peak_memory_gib']:.2f} GiB"


# --- reporting --------------------------------------------------------------------------------------------------


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| model | config | params | batch | images/s | TFLOP/s | MFU | peak GiB | vs ddp |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {r["model"]: r["images_per_sec"] for r in rows if r.get("config") == "ddp" and "images_per_sec" in r}
    for r in rows:
        if "images_per_sec" not in r:
            lines.append(f"| {r['model']} | {r['config']} | | {r.get('batch', '')} | {_short(r)} | | | | |")
            continue
        speedup = f"{r['images_per_sec'] / base[r['model']]:.2f}x" if r["model"] in base else ""
        tf = "" if r["tflops_per_sec"] is None else f"{r['tflops_per_sec']:.1f}"
        mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {r['model']} | {r['config']} | {r['params'] / 1e6:.0f}M | {r['batch']} | {r['images_per_sec']:.1f}"
            f" | {tf} | {mfu} | {r['peak_memory_gib']:.2f} | {speedup} |"
        )
    choices = [f"- {r['model']} auto, attention: {r['attention']}" for r in rows if r.get("config") == "auto"
               and r.get("attention")]
    return "\n".join(lines + ([""] + choices if choices else [])) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        found = {r["model"]: r for r in rows if r["config"] == config and "images_per_sec" in r}
        xs = [j + i * width for j, m in enumerate(models) if m in found]
        bars = ax.bar(xs, [found[m]["images_per_sec"] for m in models if m in found], width, label=config)
        for bar, m in zip(bars, [m for m in models if m in found]):
            mfu = found[m]["mfu"]
            ax.annotate("" if mfu is None else f"{100 * mfu:.0f}%", (bar.get_x() + width / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + width for j in range(len(models))], models)
    ax.set_ylabel("images/s (labels: MFU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--batch-sizes", type=int, nargs="+", help="explicit batch sizes instead of doubling to OOM")
    p.add_argument("--start-batch", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20, help="measured steps per trial")
    p.add_argument("--warmup", type=int, default=5, help="steps before the clock starts (compilation)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per trial")
    p.add_argument("--search-largest", action="store_true")
    p.add_argument("--largest-batch", type=int, default=8)
    p.add_argument("--dry-run", action="store_true", help="tiny ViT on CPU, 2 steps per trial, outputs to --out-dir")
    p.add_argument("--out-dir", type=Path, help="default: benchmarks/ (dry run: /tmp/vit_gpu_dry_run)")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trial:
        print("RESULT " + json.dumps(trial(json.loads(args.trial))), flush=True)
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("benchmarks/vit_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False). "
                 "Use --dry-run to check the pipeline on CPU.")
    if args.dry_run:
        args.steps, args.warmup, args.batch_sizes, args.largest_batch = 1, 1, args.batch_sizes or [2, 4], 2
    out = args.out_dir or (Path("/tmp/vit_gpu_dry_run") if args.dry_run else HERE)
    out.mkdir(parents=True, exist_ok=True)

    device = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    import lightning

    versions = f"torch {torch.__version__}, lightning {lightning.__version__}"
    header = f"### {time.strftime('%Y-%m-%d')} — {device}, {versions}\n\n`python {' '.join(sys.argv)}`"
    if args.search_largest:
        rows = search_largest(args)
    else:
        models = DRY_MODELS if args.dry_run else {k: MODELS[k] for k in args.models}
        rows = [best_batch(name, model, config, args) for name, model in models.items() for config in args.configs]
    (out / "vit_gpu.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    table = markdown(rows, header)
    with open(out / "RESULTS.md", "a") as f:
        f.write("\n" + table)
    if not args.search_largest:
        plot(rows, out / "vit_gpu.png")
    print(table)
    print(f"wrote {out / 'vit_gpu.json'}, appended to {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
