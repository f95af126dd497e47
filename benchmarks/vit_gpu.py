"""ViT-B/16, ViT-L/16, ViT-H/14 at 224 px on one GPU: one factor changed per row, same model, data and batch.

Usage (exact GPU-session commands: benchmarks/README.md)::

    python benchmarks/vit_gpu.py --dry-run                          # every row on CPU, tiny ViT, few steps
    python benchmarks/vit_gpu.py --models vit-b16 --write-results   # same-batch table (+ largest-batch table)
    python benchmarks/vit_gpu.py --search-largest --write-results   # largest ViT that trains on this GPU

Rows (all ``precision="bf16-mixed"``, AdamW, the examples' ``VisionTransformer``, one synthetic batch on the device):

    single        strategy="auto": plain single device, AMP O1 (autocast) - the honest 1-GPU baseline
    ddp           strategy="ddp": the same with DDP's wrapper (gradient buckets, all-reduce launches)
    ddp_compile   DDP + torch.compile of the model + AdamW(fused=True): what kernels="auto" adds, given to DDP
    eager_ac0/1   VitScaleStrategy(kernels="eager", activation_checkpointing=False/True): FSDP2 + O2 + fp32 norms
    auto_ac0/1    VitScaleStrategy(kernels="auto", ...): + per-block compile, fused AdamW, attention choice
    auto_acplan   VitScaleStrategy(kernels="auto", activation_checkpointing="auto"): the planner's choice
                  (skipped with a note where the installed lightning_vitscale refuses "auto")

Table 1 runs every row at one batch per model (``--batch``); table 2 finds each row's largest batch by binary
search (out-of-memory decided by exception type) and reports its throughput there. Each trial is its own
subprocess, so an out-of-memory error cannot leave allocator state behind. Timing: CUDA events at window edges
only (benchmarks/timing.py), median and range over ``--windows`` windows after ``--warmup`` steps; peak memory
is reset when warm-up ends. MFU: see ``tables.MFU_FORMULA``, printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # `python benchmarks/vit_gpu.py` puts benchmarks/, not the repo root, on the path
    sys.path.insert(0, str(ROOT))

from benchmarks.search import OK, classify_failure, largest_batch  # noqa: E402
from benchmarks.tables import MFU_FORMULA, fmt, markdown_table, mfu, train_flops_per_sample  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One configuration: everything not named here is identical across rows."""

    label: str
    strategy: str  # "auto" | "ddp" | "vitscale"
    kernels: str | None = None
    ac: bool | str | None = None
    compile_model: bool = False
    fused_adamw: bool = False


ROWS: dict[str, Row] = {
    "single": Row("single device, AMP O1", "auto"),
    "ddp": Row("DDP, AMP O1", "ddp"),
    "ddp_compile": Row("DDP, AMP O1, compiled + fused AdamW", "ddp", compile_model=True, fused_adamw=True),
    "eager_ac0": Row("VitScale eager, AC off", "vitscale", "eager", False),
    "eager_ac1": Row("VitScale eager, AC on", "vitscale", "eager", True),
    "auto_ac0": Row("VitScale auto, AC off", "vitscale", "auto", False),
    "auto_ac1": Row("VitScale auto, AC on", "vitscale", "auto", True),
    "auto_acplan": Row("VitScale auto, AC planned", "vitscale", "auto", "auto"),
}

# name -> (size in examples/models/vit.py VIT_SIZES or explicit ViTSize fields, image size, batch for table 1)
MODELS: dict[str, dict[str, Any]] = {
    "vit-b16": dict(size="vit-b16", image=224, batch=128),
    "vit-l16": dict(size="vit-l16", image=224, batch=64),
    "vit-h14": dict(size="vit-h14", image=224, batch=32),
}
DRY_MODEL = dict(fields=dict(embed_dim=32, depth=2, num_heads=2, mlp_dim=64, patch_size=8), image=32, batch=2)
# --search-largest: increasing parameter counts, FAIR-style widths (multiples of 128); 1 GPU holds ~16 B/param.
LADDER: dict[str, dict[str, Any]] = {
    "vit-h14": dict(size="vit-h14", image=224),
    "vit-g14": dict(size="vit-g14", image=224),
    "vit-G14": dict(size="vit-G14", image=224),
    "vit-2.6b": dict(fields=dict(embed_dim=2048, depth=48, num_heads=16, mlp_dim=8192, patch_size=14), image=224),
    "vit-3.5b": dict(fields=dict(embed_dim=2560, depth=40, num_heads=20, mlp_dim=10240, patch_size=14), image=224),
    "vit-5b": dict(size="vit-5b", image=224),
}
DRY_LADDER = {"dry-1": DRY_MODEL, "dry-2": dict(DRY_MODEL, fields=dict(DRY_MODEL["fields"], depth=3))}
CLASSES = 1000


def build_vit(model: dict[str, Any]):
    """The examples' plain ``VisionTransformer`` for a named size or explicit fields."""
    from examples.models.vit import VIT_SIZES, VisionTransformer

    f = model.get("fields") or asdict(VIT_SIZES[model["size"]])
    return VisionTransformer(
        model["image"], f["patch_size"], 3, CLASSES, f["embed_dim"], f["depth"], f["num_heads"], mlp_dim=f["mlp_dim"]
    )


def planner_available() -> str | None:
    """``None`` if ``activation_checkpointing="auto"`` is accepted, else why the planned row is skipped."""
    from lightning_vitscale import VitScaleStrategy

    try:
        VitScaleStrategy(activation_checkpointing="auto")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        return f"skipped: the installed lightning_vitscale refuses activation_checkpointing='auto' ({exc})"
    return None


# --- one trial, in its own process -------------------------------------------------------------------------


def make_strategy(row: Row):
    from lightning_vitscale import VitScaleStrategy

    if row.strategy != "vitscale":
        return row.strategy
    return VitScaleStrategy(kernels=row.kernels, activation_checkpointing=row.ac)


def trial(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``warmup + windows x steps`` batches; return per-window seconds and peak memory, or the failure."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, IterableDataset

    from benchmarks.timing import WindowTimer, clock_for

    device = torch.device(spec["device"])
    row, batch, image = Row(**spec["row"]), spec["batch"], spec["model"]["image"]
    cuda = device.type == "cuda"

    class Bench(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with device:  # built on the device: a billion-parameter ViT initialises in seconds there
                self.net = build_vit(spec["model"])
            if row.compile_model:
                self.net.compile()  # in place, before Lightning wraps it in DDP

        def training_step(self, data, batch_idx):
            images, labels = data
            if spec.get("fake_oom_above") is not None and batch > spec["fake_oom_above"]:
                raise torch.OutOfMemoryError(f"simulated: batch {batch} > {spec['fake_oom_above']} (--fake-oom-above)")
            return F.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.05, fused=row.fused_adamw or None)

    timer = WindowTimer(
        spec["warmup"], spec["steps"], spec["windows"], clock_for(device),
        on_measure_start=torch.cuda.reset_peak_memory_stats if cuda else None,
    )

    class Timing(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            timer.step()

    class SameBatch(IterableDataset):
        """One batch made on the device, yielded every step: no host work or transfer is timed."""

        def __iter__(self):
            images = torch.randn(batch, 3, image, image, device=device)
            labels = torch.randint(0, CLASSES, (batch,), device=device)
            return iter([(images, labels)] * timer.total_steps)

    try:
        trainer = L.Trainer(
            accelerator=device.type, devices=1, strategy=make_strategy(row), precision="bf16-mixed",
            max_steps=timer.total_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[Timing()],
        )
        trainer.fit(Bench(), DataLoader(SameBatch(), batch_size=None))
        seconds = timer.window_seconds()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a recorded row, by exception type
        return {"status": classify_failure(exc), "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
    plan = getattr(trainer.strategy, "plan", None)
    return {
        "status": OK,
        "window_seconds": seconds,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "checkpointed_blocks": len(plan.checkpointed) if plan is not None else 0,
        "attention": plan.kernels.get("attention") if plan is not None else None,
    }


def run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``trial(spec)`` in a fresh process; a crash or a timeout is a status too, never an exception here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MASTER_PORT=str(port))
    cmd = [sys.executable, str(Path(__file__)), "--trial", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "message": f"no result after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"status": f"crash (exit {proc.returncode})", "message": (proc.stdout + proc.stderr)[-1500:]}
    return json.loads(lines[-1][len("RESULT "):])


# --- sweeps --------------------------------------------------------------------------------------------------


def measure(name: str, model: dict, row_key: str, batch: int, args: argparse.Namespace, flops: float) -> dict:
    """One trial of ``row_key`` at ``batch``, summarised: median/min/max images/s over windows, TFLOP/s, MFU."""
    from benchmarks.timing import rates, summarize

    spec = dict(model=model, row=asdict(ROWS[row_key]), batch=batch, steps=args.steps, windows=args.windows,
                warmup=args.warmup, device=args.device, fake_oom_above=args.fake_oom_above)
    outcome = trial(spec) if args.in_process else run_trial(spec, args.timeout)
    result = dict(outcome, model=name, row=row_key, batch=batch)
    if result["status"] == OK:
        spread = summarize(rates(batch, args.steps, result["window_seconds"]))
        result.update(images_per_sec=spread.median, low=spread.low, high=spread.high, windows=spread.n,
                      tflops=flops * spread.median / 1e12, mfu=mfu(flops, spread.median, args.peak_flops))
    print(f"{name:9s} {row_key:12s} batch {batch:5d}: {short(result)}", flush=True)
    if getattr(args, "rows_log", None) is not None:  # every trial as it ends: a sweep cut short keeps its rows
        with open(args.rows_log, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def short(r: dict) -> str:
    if r["status"] != OK:
        return f"{r['status']} ({r.get('message', '').splitlines()[0] if r.get('message') else ''})"
    mem = "" if r["peak_allocated_gib"] is None else f", peak {r['peak_allocated_gib']:.2f} GiB"
    return f"{r['images_per_sec']:.1f} img/s [{r['low']:.1f}-{r['high']:.1f}]{mem}"


def same_batch_rows(models: dict, rows: list[str], args: argparse.Namespace, flops: dict) -> list[dict]:
    out = []
    for name, model in models.items():
        batch = args.batch or model["batch"]
        out += [measure(name, model, key, batch, args, flops[name]) for key in rows]
    return out


def largest_batch_rows(models: dict, rows: list[str], args: argparse.Namespace, flops: dict) -> list[dict]:
    out = []
    for name, model in models.items():
        for key in rows:
            measured: dict[int, dict] = {}

            def attempt(batch: int, name=name, model=model, key=key, measured=measured) -> str:
                measured[batch] = measure(name, model, key, batch, args, flops[name])
                return measured[batch]["status"]

            search = largest_batch(attempt, args.search_start, args.search_limit, args.search_granularity)
            best = measured[search.largest] if search.largest else {"status": search.stopped_by, "batch": None}
            out.append(dict(best, model=name, row=key, stopped_by=search.stopped_by, trials=search.trials))
    return out


def ladder_rows(args: argparse.Namespace) -> list[dict]:
    """The largest ViT of the ladder that trains (kernels="auto", AC on) at ``--largest-batch``."""
    out = []
    for name, model in (DRY_LADDER if args.dry_run else LADDER).items():
        flops = train_flops_per_sample(lambda model=model: build_vit(model), (3, model["image"], model["image"]))
        result = measure(name, model, "auto_ac1", args.largest_batch, args, flops)
        out.append(result)
        if result["status"] != OK:
            break
    return out


# --- reporting -----------------------------------------------------------------------------------------------


def same_batch_table(rows: list[dict], skipped: dict[str, str]) -> str:
    base = {(r["model"], r["row"]): r.get("images_per_sec") for r in rows}
    body = []
    for r in rows:
        ok = r["status"] == OK
        vs = [fmt(r["images_per_sec"] / b, ".2f", suffix="x") if ok and b else None
              for b in (base.get((r["model"], "single")), base.get((r["model"], "ddp")))]
        body.append([
            r["model"], ROWS[r["row"]].label, r["batch"], fmt(r.get("images_per_sec")),
            f"{r['low']:.1f}-{r['high']:.1f} (n={r['windows']})" if ok else None,
            fmt(r.get("tflops")), fmt(r.get("mfu"), ".1f", 100, "%"), fmt(r.get("peak_allocated_gib"), ".2f"),
            *vs, "ok" if ok else f"{r['status']}: {r.get('message', '')[:80]}",
        ])
    body += [["", ROWS[k].label, None, None, None, None, None, None, None, None, note] for k, note in skipped.items()]
    headers = ["model", "row", "batch", "images/s (median)", "range over windows", "TFLOP/s", "MFU", "peak GiB",
               "vs single", "vs DDP", "status"]
    return markdown_table(headers, body)


def largest_table(rows: list[dict]) -> str:
    body = [[
        r["model"], ROWS[r["row"]].label, r.get("batch"), r["stopped_by"], fmt(r.get("images_per_sec")),
        fmt(r.get("mfu"), ".1f", 100, "%"), fmt(r.get("peak_allocated_gib"), ".2f"),
        " ".join(f"{b}:{s}" for b, s in r["trials"]),
    ] for r in rows]
    headers = ["model", "row", "largest batch", "search stopped by", "images/s", "MFU", "peak GiB", "trials"]
    return markdown_table(headers, body)


def ladder_table(rows: list[dict]) -> str:
    body = [[r["model"], r["batch"], fmt(r.get("images_per_sec")), fmt(r.get("mfu"), ".1f", 100, "%"),
             fmt(r.get("peak_allocated_gib"), ".2f"), r["status"]] for r in rows]
    return markdown_table(["model", "batch", "images/s", "MFU", "peak GiB", "status"], body)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    keys = list(dict.fromkeys(r["row"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        found = {r["model"]: r for r in rows if r["row"] == key and r["status"] == OK}
        xs = [j + i * width for j, m in enumerate(models) if m in found]
        ys = [found[m]["images_per_sec"] for m in models if m in found]
        errs = [[found[m]["images_per_sec"] - found[m]["low"] for m in models if m in found],
                [found[m]["high"] - found[m]["images_per_sec"] for m in models if m in found]]
        ax.bar(xs, ys, width, yerr=errs, label=ROWS[key].label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    ax.set_ylabel("images/s (median, bars: min-max over windows)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def header(args: argparse.Namespace, device: str) -> str:
    import lightning
    import torch

    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    peak = "unknown (MFU not shown)" if not args.peak_flops else f"{args.peak_flops / 1e12:.0f} TFLOP/s"
    clock = "CUDA events at window edges only (no per-step sync)" if args.device == "cuda" else "host clock"
    isolation = "all trials in one process" if args.in_process else "each trial a fresh process"
    return (
        f"### {time.strftime('%Y-%m-%d %H:%M')} — {device}\n\n"
        f"torch {torch.__version__}{cuda}, lightning {lightning.__version__}. Command: "
        f"`python benchmarks/vit_gpu.py {' '.join(sys.argv[1:])}`\n\n"
        f"Timing: {clock}, {args.warmup} warm-up steps, then {args.windows} windows x {args.steps} steps;"
        f" {isolation}; peak memory (allocator) reset after warm-up. Peak dense bf16: {peak}. {MFU_FORMULA}\n"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--tables", nargs="+", choices=("same", "largest"), default=["same", "largest"])
    p.add_argument("--batch", type=int, help="table 1 batch for every model (default: per model, see MODELS)")
    p.add_argument("--steps", type=int, default=10, help="steps per timing window")
    p.add_argument("--windows", type=int, default=5, help="timing windows (>= 3 for a median and a range)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, attention choice)")
    p.add_argument("--search-start", type=int, default=16)
    p.add_argument("--search-limit", type=int, default=1024)
    p.add_argument("--search-granularity", type=int, default=8, help="stop bisecting when bounds are this close")
    p.add_argument("--search-largest", action="store_true", help="instead of the tables: the largest ViT that trains")
    p.add_argument("--largest-batch", type=int, default=8)
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s for MFU (default: the GPU's dense bf16 peak)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per trial")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny ViT on CPU, 3 windows of 1 step, simulated out-of-memory above batch 3")
    p.add_argument("--fake-oom-above", type=int, help=argparse.SUPPRESS)
    p.add_argument("--in-process", action="store_true", help="no subprocess per trial (the dry run's default:"
                   " a CPU trial leaves no allocator state behind)")
    p.add_argument("--write-results", action="store_true",
                   help="append the tables to OUT_DIR/RESULTS.md and plot table 1 to OUT_DIR/vit_gpu_<models>.png")
    p.add_argument("--out-dir", type=Path, help="default: benchmarks/ (dry run: /tmp/vit_gpu_dry_run)")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.trial:
        print("RESULT " + json.dumps(trial(json.loads(args.trial))), flush=True)
        return
    import torch

    from lightning_vitscale.monitoring.throughput import device_peak_flops

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("benchmarks/vit_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "`--dry-run` checks every row on CPU.")
    if args.dry_run:
        args.steps, args.windows, args.warmup, args.largest_batch = 1, 3, 1, 2
        args.search_start, args.search_limit, args.search_granularity = 2, 16, 1
        args.fake_oom_above, args.in_process = 3 if args.fake_oom_above is None else args.fake_oom_above, True
    args.device = "cpu" if args.dry_run else "cuda"
    args.peak_flops = args.peak_flops or device_peak_flops(torch.device(args.device))
    device = torch.cuda.get_device_name() if not args.dry_run else (
        f"CPU (dry run: tiny ViT, simulated out-of-memory above batch {args.fake_oom_above})")
    out = args.out_dir or (Path("/tmp/vit_gpu_dry_run") if args.dry_run else HERE)
    out.mkdir(parents=True, exist_ok=True)
    args.rows_log = out / "vit_gpu_trials.jsonl"
    report = [header(args, device)]
    rows, skipped = list(args.rows), {}
    if "auto_acplan" in rows and (why := planner_available()) is not None:
        rows.remove("auto_acplan")
        skipped["auto_acplan"] = why
    if args.search_largest:
        ladder = ladder_rows(args)
        report.append("Largest ViT that trains (VitScale auto, AC on, batch"
                      f" {args.largest_batch}):\n\n" + ladder_table(ladder))
        results: dict[str, Any] = {"ladder": ladder}
    else:
        models = {"vit-dry": DRY_MODEL} if args.dry_run else {k: MODELS[k] for k in args.models}
        flops = {name: train_flops_per_sample(lambda m=m: build_vit(m), (3, m["image"], m["image"]))
                 for name, m in models.items()}
        results = {"flops_per_image": flops, "skipped": skipped}
        report.append("Model FLOPs per image (3 x forward): "
                      + ", ".join(f"{name} {f / 1e9:.4g} GFLOP" for name, f in flops.items()) + "\n")
        if "same" in args.tables:
            results["same"] = same_batch_rows(models, rows, args, flops)
            report.append("Same batch for every row:\n\n" + same_batch_table(results["same"], skipped))
        if "largest" in args.tables:
            results["largest"] = largest_batch_rows(models, rows, args, flops)
            report.append("Each row at its largest batch (binary search):\n\n" + largest_table(results["largest"]))
    stem = "vit_gpu_" + ("largest_vit" if args.search_largest else "_".join(["dry"] if args.dry_run else args.models))
    (out / f"{stem}.json").write_text(json.dumps(dict(device=device, **results), indent=1))
    text = "\n".join(report)
    print("\n" + text)
    if args.write_results:
        if "same" in results:
            plot(results["same"], out / f"{stem}.png")
            text += f"\n![images/s per row]({stem}.png)\n"
        with open(out / "RESULTS.md", "a") as f:
            f.write("\n" + text)
        print(f"appended to {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
