"""Where a training step's time goes on one GPU, per row of benchmarks/vit_gpu.py: a torch.profiler window.

Usage::

    python benchmarks/gpu_profile.py --model vit-h14 --batch 32 --rows single eager_ac0 --out profile.json
    python benchmarks/gpu_profile.py --dry-run --out /tmp/profile.json     # tiny ViT on CPU

Each row trains ``--warmup`` steps, then profiles ``--steps`` steps (CPU and CUDA activity) inside Lightning's
loop. Reported per step: host wall time, the time the GPU spent in kernels (their sum: overlap on several
streams counts twice), kernel launches, and the operators with the most device and host time. A step whose host
time far exceeds its kernel time is launch- or Python-bound: the GPU waits for the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.vit_gpu import CLASSES, DRY_MODEL, MODELS, ROWS, build_vit, make_strategy  # noqa: E402


def profile_row(row_key: str, model: dict[str, Any], batch: int, warmup: int, steps: int, device: str,
                top: int) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import DataLoader

    dev = torch.device(device)
    row = ROWS[row_key]
    cuda = dev.type == "cuda"

    class Bench(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with dev:
                self.net = build_vit(model)

        def forward(self, images):
            return self.net(images)

        def training_step(self, data, batch_idx):
            images, labels = data
            return F.cross_entropy(self(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.05)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    marks: list[float] = []

    class Window(L.Callback):
        def on_train_batch_end(self, trainer, *args: Any) -> None:
            done = trainer.global_step
            if done == warmup:
                if cuda:
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())
                prof.start()
            elif done == warmup + steps:
                if cuda:
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())
                prof.stop()

    images = torch.randn(batch, 3, model["image"], model["image"], device=dev)
    labels = torch.randint(0, CLASSES, (batch,), device=dev)
    trainer = L.Trainer(accelerator=dev.type, devices=1, strategy=make_strategy(row), precision="bf16-mixed",
                        max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Window()])
    trainer.fit(Bench(), DataLoader([(images, labels)] * (warmup + steps), batch_size=None))
    return summarize_profile(prof, row_key, batch, steps, (marks[1] - marks[0]) / steps, cuda, top)


def summarize_profile(prof: Any, row_key: str, batch: int, steps: int, wall: float, cuda: bool,
                      top: int) -> dict[str, Any]:
    """Per step: host time, kernel time and launches (GPU-side annotation ranges, which span the kernels they
    enclose, left out), and the operators with the most device and host time."""
    events = prof.key_averages()
    device_time = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)]

    def rows_by(attr: str) -> list[dict[str, Any]]:
        ordered = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
        return [dict(name=e.key[:90], calls=e.count // steps, ms_per_step=getattr(e, attr) / 1e3 / steps)
                for e in ordered]

    return dict(row=row_key, batch=batch, steps=steps, host_ms_per_step=wall * 1e3,
                kernel_ms_per_step=sum(_device_us(k) for k in kernels) / 1e3 / steps if cuda else None,
                kernels_per_step=len(kernels) / steps if cuda else None, host_by_kind=host_by_kind(events, steps),
                by_device_time=rows_by(device_time) if cuda else [], by_host_time=rows_by("self_cpu_time_total"))


HOST_KINDS = {  # event name prefix -> kind; ranges (FSDP's hooks, the optimizer step) count their children's time
    "FSDP::": "FSDP hooks and copies", "Optimizer.step": "optimizer step", "PythonSubclass": "DTensor dispatch",
    "cudaLaunchKernel": "kernel launches", "cuLaunchKernel": "kernel launches", "aten::copy_": "copies and casts",
    "aten::_to_copy": "copies and casts", "CheckpointFunction": "recompute", "autograd::engine": "autograd nodes",
}
RANGES = ("FSDP::", "Optimizer.step")


def host_by_kind(events: Any, steps: int) -> dict[str, float]:
    """Host milliseconds per step by kind (:data:`HOST_KINDS`): where a host-bound step's time goes. Ranges count
    their total (their own ops inside them counted there too), the rest their own time; the profiler inflates both."""
    kinds: dict[str, float] = {}
    for event in events:
        kind = next((k for prefix, k in HOST_KINDS.items() if event.key.startswith(prefix)), None)
        if kind is None:
            continue
        attr = "cpu_time_total" if event.key.startswith(RANGES) else "self_cpu_time_total"
        kinds[kind] = kinds.get(kind, 0.0) + getattr(event, attr) / 1e3 / steps
    return kinds


def _device_us(event: Any) -> float:
    """A kernel event's device time (``cuda_time_total`` before torch renamed it)."""
    value = getattr(event, "device_time_total", None)
    return float(value if value is not None else event.cuda_time_total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="vit-h14")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=["single", "eager_ac0"])
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = DRY_MODEL if args.dry_run else MODELS[args.model]
    device = "cpu" if args.dry_run else "cuda"
    batch = 2 if args.dry_run else args.batch
    results = []
    for key in args.rows:
        try:
            results.append(profile_row(key, model, batch, args.warmup, args.steps, device, args.top))
        except Exception as exc:  # noqa: BLE001 - a failing row is recorded, the next one runs
            results.append(dict(row=key, error=f"{type(exc).__name__}: {str(exc)[:500]}"))
        r = results[-1]
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("by_")}), flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    for r in results:
        for key in ("by_device_time", "by_host_time"):
            print(f"\n{r['row']} {key}:")
            for e in r.get(key, []):
                print(f"  {e['ms_per_step']:9.2f} ms  {e['calls']:6d}x  {e['name']}")


if __name__ == "__main__":
    main()
