"""ViT-B/16, ViT-L/16, ViT-H/14 at 224 px on one GPU: one factor changed per row, same model, data and batch.

Usage (exact GPU-session commands: benchmarks/README.md)::

    python benchmarks/vit_gpu.py --dry-run                          # every row on CPU, tiny ViT, few steps
    python benchmarks/vit_gpu.py --models vit-b16 --write-results   # same-batch table (+ largest-batch table)
    python benchmarks/vit_gpu.py --search-largest --write-results   # largest ViT that trains on this GPU
    python benchmarks/vit_gpu.py --planner                          # the planner's peak vs max_memory_allocated
    bash benchmarks/gpu_run.sh OUT_DIR                              # all of it in one ~8 min call (gpu_run.sh)

Rows (all ``precision="bf16-mixed"``, AdamW, the examples' ``VisionTransformer``, one synthetic batch on the device):

    single        strategy="auto": plain single device, AMP O1 (autocast) - the honest 1-GPU baseline
    ddp           strategy="ddp": the same with DDP's wrapper (gradient buckets, all-reduce launches)
    default       VitScaleStrategy() exactly as a user writes it: what a drop-in user gets
    recipe        the recipe's memory-first setting (:data:`RECIPE`: every block checkpointed, its own FSDP unit,
                  resharded after forward)
    ddp_compile   DDP + torch.compile of the model + AdamW(fused=True): what kernels="auto" adds, given to DDP
    eager_ac0/1   VitScaleStrategy(kernels="eager", activation_checkpointing=False/True): FSDP2 + O2 + fp32 norms
    auto_ac0/1    VitScaleStrategy(kernels="auto", ...): + per-block compile, fused AdamW, attention choice
    auto_acplan   VitScaleStrategy(kernels="auto", activation_checkpointing="auto"): the planner's choice
                  (skipped with a note where the installed lightning_vitscale refuses "auto")
    eager_acplan  VitScaleStrategy(kernels="eager", activation_checkpointing="auto"): the planner's cells only

Table 1 runs every row at one batch per model (``--batch``); with ``--second-batch`` the same trial goes on at a
second batch (its own warm-up and windows), so each row's peak memory is known at two batches. Table 2 gives
each row its largest batch: ``--largest fit`` (default) extrapolates those two peaks linearly to
``--memory-fraction`` of the device's memory, tries that batch and steps down 20% on out-of-memory; ``--largest
search`` bisects (one trial per probe). Out-of-memory is decided by exception type. Each trial is its own
subprocess, so an out-of-memory error cannot leave allocator state behind. Timing: CUDA events at window edges
only (benchmarks/timing.py), median and range over ``--windows`` windows after ``--warmup`` steps; peak memory
is reset when warm-up ends. MFU: see ``tables.MFU_FORMULA``, printed with the tables. ``--planner`` runs the
memory planner's cells instead: ``example_input_array`` set, so setup predicts the step's peak
(``strategy.plan.predicted_peak``), held against ``torch.cuda.max_memory_allocated`` over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

from benchmarks.search import OK, OOM, classify_failure, fit_largest, largest_batch, step_down  # noqa: E402
from benchmarks.tables import MFU_FORMULA, fmt, markdown_table, mfu, train_flops_per_sample  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One configuration: everything not named here is identical across rows. VitScale rows pass ``kernels`` and
    ``activation_checkpointing`` only where set (``None``: the strategy's default), and :data:`RECIPE` with
    ``recipe``."""

    label: str
    strategy: str  # "auto" | "ddp" | "vitscale"
    kernels: str | None = None
    ac: bool | str | None = None
    compile_model: bool = False
    fused_adamw: bool = False
    recipe: bool = False


RECIPE: dict[str, Any] = dict(priority="memory")
"""The recipe's memory-first setting as users spell it (every block checkpointed, its own FSDP unit, resharded after
forward), named in one place: the ``recipe`` row, and the 40 GB table's."""

ROWS: dict[str, Row] = {
    "single": Row("single device, AMP O1", "auto"),
    "ddp": Row("DDP, AMP O1", "ddp"),
    "default": Row("VitScaleStrategy() (the default)", "vitscale"),
    "recipe": Row("VitScale recipe, memory-first", "vitscale", recipe=True),
    "ddp_compile": Row("DDP, AMP O1, compiled + fused AdamW", "ddp", compile_model=True, fused_adamw=True),
    "eager_ac0": Row("VitScale eager, AC off", "vitscale", "eager", False),
    "eager_ac1": Row("VitScale eager, AC on", "vitscale", "eager", True),
    "auto_ac0": Row("VitScale auto, AC off", "vitscale", "auto", False),
    "auto_ac1": Row("VitScale auto, AC on", "vitscale", "auto", True),
    "auto_acplan": Row("VitScale auto, AC planned", "vitscale", "auto", "auto"),
    "eager_acplan": Row("VitScale eager, AC planned", "vitscale", "eager", "auto"),
}
TABLE_ROWS = [key for key in ROWS if key != "eager_acplan"]  # the throughput tables' default rows
CAP_ROWS = ["single", "ddp", "default", "recipe"]  # the table at a 40 GB cap (--memory-cap-gib)
PLANNER_ROWS = ["eager_ac0", "eager_ac1", "eager_acplan"]

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
    given = {key: value for key, value in (("kernels", row.kernels), ("activation_checkpointing", row.ac))
             if value is not None}
    return VitScaleStrategy(**given, **(RECIPE if row.recipe else {}))


def trial(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``warmup + windows x steps`` batches per phase: one per batch of ``spec["batches"]`` (default
    ``[spec["batch"]]``), then, with ``spec["largest"]``, one at the batch the first two phases' peaks extrapolate
    to (:func:`benchmarks.search.fit_largest`), so a row's largest batch costs no extra process or compilation.
    Returns each phase's window seconds and peak memory (phase 1's also at the top level), or the failure; an
    out-of-memory error in the largest-batch phase is that phase's status, the measured phases are kept."""
    import lightning as L
    from torch.utils.data import DataLoader

    phases = Phases(spec)
    failure, trainer = None, None
    try:
        trainer = L.Trainer(
            accelerator=phases.device.type, devices=1, strategy=make_strategy(Row(**spec["row"])),
            precision="bf16-mixed", max_steps=phases.total_steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[timing_callback(phases)],
        )
        trainer.fit(bench_module(spec, phases), DataLoader(phases.indices(), batch_size=None))
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a recorded row, by exception type
        failure = {"status": classify_failure(exc), "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return phases.result(failure, getattr(trainer, "strategy", None))


class Phases:
    """A trial's phases: their batches (the largest-batch phase's fitted when it starts), timers and results."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from benchmarks.timing import WindowTimer, clock_for

        self.spec = spec
        self.device = torch.device(spec["device"])
        self.cuda = self.device.type == "cuda"
        self.fake = FakeMemory(*spec["fake_memory"]) if spec.get("fake_memory") else None
        self.cap = spec.get("memory_cap_gib")
        if self.cap and self.cuda:  # the A100-40GB regime on a larger GPU: the allocator and the planner see 40 GB
            torch.cuda.set_per_process_memory_fraction(self.cap * 2**30 / torch.cuda.mem_get_info()[1])
        timing = dict(warmup=spec["warmup"], steps=spec["steps"], windows=spec["windows"])
        self.phases: list[dict[str, Any]] = [dict(batch=b, **timing) for b in spec.get("batches") or [spec["batch"]]]
        self.fixed = len(self.phases)
        self.largest = spec.get("largest")
        if self.largest:
            self.phases.append(dict(batch=None, fit=None, warmup=self.largest["warmup"], steps=self.largest["steps"],
                                    windows=self.largest["windows"]))
        clock = clock_for(self.device)
        self.timers = [WindowTimer(p["warmup"], p["steps"], p["windows"], clock, on_measure_start=self.reset_peak)
                       for p in self.phases]
        self.done: list[dict[str, Any]] = []  # finished phases, with their peaks

    @property
    def total_steps(self) -> int:
        return sum(t.total_steps for t in self.timers)

    def indices(self) -> Any:
        """Each step's phase index, as a dataset; the batch itself is made at step time (``batch_of``)."""
        from torch.utils.data import IterableDataset

        steps = [i for i, timer in enumerate(self.timers) for _ in range(timer.total_steps)]

        class PhaseIndices(IterableDataset):
            def __iter__(self):
                return iter(steps)

        return PhaseIndices()

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def device_memory_gib(self) -> float | None:
        if self.fake is not None:
            return min(self.fake.total_gib, self.cap or self.fake.total_gib)
        if not self.cuda:
            return None
        import torch

        return self.cap or torch.cuda.mem_get_info()[1] / 2**30

    def batch_of(self, index: int) -> int:
        """Phase ``index``'s batch; the largest-batch phase's from the two measured peaks, at its first step."""
        phase = self.phases[index]
        if phase["batch"] is None:
            points = [(p["batch"], p["peak_allocated_gib"]) for p in self.done[:2]]
            memory = self.device_memory_gib()
            if len(points) < 2 or memory is None or any(peak is None for _, peak in points):
                raise RuntimeError(f"no largest-batch fit: peaks {points}, device memory {memory}")
            largest = self.largest
            fit = fit_largest(points, memory, largest["memory_fraction"], largest["granularity"], largest["limit"])
            phase.update(batch=fit.batch, fit=asdict(fit))
        return int(phase["batch"])

    def step_done(self) -> None:
        """After each training step: the current phase's timer; its peaks once its last window ended."""
        phase, timer = self.phases[len(self.done)], self.timers[len(self.done)]
        timer.step()
        if not timer.done:
            return
        allocated, reserved = self._peaks(int(phase["batch"]))
        self.done.append(dict(batch=phase["batch"], window_seconds=timer.window_seconds(),
                              peak_allocated_gib=allocated, peak_reserved_gib=reserved,
                              **({"fit": phase["fit"]} if "fit" in phase else {})))
        if self.spec.get("report_phases"):  # run_trial keeps finished phases of a trial it has to kill
            print("PHASE " + json.dumps(self.done[-1]), flush=True)

    def _peaks(self, batch: int) -> tuple[float | None, float | None]:
        if self.fake is not None:
            return self.fake.peak_gib(batch), None
        if not self.cuda:
            return None, None
        import torch

        # the caching allocator's counters live on the host: reading them needs no device sync
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30

    def result(self, failure: dict[str, Any] | None, strategy: Any) -> dict[str, Any]:
        if failure is not None and len(self.done) < self.fixed:
            return failure
        result: dict[str, Any] = {"status": OK, **{k: v for k, v in self.done[0].items() if k != "batch"},
                                  "phases": self.done[: self.fixed], "device_memory_gib": self.device_memory_gib()}
        if self.largest:
            last = self.phases[-1]
            result["largest"] = (dict(self.done[self.fixed], status=OK) if failure is None
                                 else dict(failure, batch=last["batch"]))
            result["largest"]["fit"] = last["fit"]
        plan = getattr(strategy, "plan", None)
        predicted = getattr(plan, "predicted_peak", None)
        result.update(
            predicted_peak_gib=predicted / 2**30 if predicted else None,
            checkpointed_blocks=len(plan.checkpointed) if plan is not None else 0,
            selective_blocks=len(plan.selective) if plan is not None else 0,
            blocks_per_unit=getattr(plan, "blocks_per_unit", None),
            attention=plan.kernels.get("attention") if plan is not None else None,
            compiled_blocks=plan.kernels.get("compiled blocks") if plan is not None else None,
            kept_gathered=_kept_gathered(getattr(strategy, "model", None)),
            memory_line=getattr(plan, "memory", None) or None,
            memory_cap_gib=self.cap,
            guard_on_device=_guard_on_device(strategy),
        )
        return result


def _guard_on_device(strategy: Any) -> bool | None:
    """Whether the non-finite guard handed its decisions to a fused step (no host sync per step), for the
    throughput model; ``None`` outside VitScale or without the guard."""
    guard = getattr(getattr(strategy, "precision_plugin", None), "nonfinite_guard", None)
    return None if guard is None else guard.decided_on_device > 0


def _kept_gathered(outer: Any) -> int | None:
    """Block units that stay gathered from forward to backward (FSDP2's ``reshard_after_forward=False``), for the
    throughput model's settings of a planned row; ``None`` outside VitScale."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_vitscale._compat import unit_keeps_gathered

    units = [m for m in outer.modules() if m is not outer and isinstance(m, FSDPModule)] if outer is not None else []
    return sum(unit_keeps_gathered(unit) for unit in units) if units else None


def bench_module(spec: dict[str, Any], phases: Phases) -> Any:
    """The benchmark's LightningModule: the ViT built on the device, AdamW, a cross-entropy step."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    row, image, device = Row(**spec["row"]), spec["model"]["image"], phases.device

    class Bench(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with device:  # built on the device: a billion-parameter ViT initialises in seconds there
                self.net = build_vit(spec["model"])
            if row.compile_model:
                self.net.compile()  # in place, before Lightning wraps it in DDP
            if spec.get("plan"):  # the batch known at setup: the planner predicts the step's peak
                self.example_input_array = torch.empty(phases.phases[0]["batch"], 3, image, image)
            self.inputs: tuple[int, Any, Any] | None = None

        def forward(self, images):
            return self.net(images)

        def on_after_batch_transfer(self, phase_index, dataloader_idx):
            """The phase's batch, made on the device once per phase, when its first step runs (not when the loop
            prefetches it: the last phase's batch is decided by the peaks the phases before it measured)."""
            batch = phases.batch_of(phase_index)
            if self.inputs is None or self.inputs[0] != batch:
                self.inputs = None  # the previous phase's tensors go before the next phase's are made
                images = torch.randn(batch, 3, image, image, device=device)
                self.inputs = (batch, images, torch.randint(0, CLASSES, (batch,), device=device))
            return self.inputs[1:]

        def training_step(self, data, batch_idx):
            images, labels = data
            limit = spec.get("fake_oom_above")
            if limit is not None and images.shape[0] > limit:
                raise torch.OutOfMemoryError(f"simulated: batch {images.shape[0]} > {limit} (--fake-oom-above)")
            return F.cross_entropy(self(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.05, fused=row.fused_adamw or None)

    return Bench()


def timing_callback(phases: Phases) -> Any:
    import lightning as L

    class Timing(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            phases.step_done()

    return Timing()


@dataclass(frozen=True)
class FakeMemory:
    """The dry run's stand-in for a GPU's memory: ``base + per_sample x batch`` GiB of ``total`` (CPU has no
    allocator peak), so the largest-batch fit runs its arithmetic and its out-of-memory retries on CPU."""

    base_gib: float
    per_sample_gib: float
    total_gib: float

    def peak_gib(self, batch: int) -> float:
        return self.base_gib + self.per_sample_gib * batch


def run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``trial(spec)`` in a fresh process; a crash or a timeout is a status too, never an exception here. On a
    timeout the process group goes (compile workers too), and the phases the trial finished are kept."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(Path(__file__)), "--trial", json.dumps(dict(spec, report_phases=True))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return partial_result(stdout, spec, f"no result after {timeout:.0f} s")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"status": f"crash (exit {proc.returncode})", "message": (stdout + stderr)[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def partial_result(stdout: str, spec: dict[str, Any], why: str) -> dict[str, Any]:
    """What a trial killed by its timeout had finished (its ``PHASE`` lines): the measured phases as a result
    whose unfinished largest-batch phase says ``timeout``; ``timeout`` alone if not even phase 1 finished."""
    done = [json.loads(line[len("PHASE "):]) for line in stdout.splitlines() if line.startswith("PHASE ")]
    fixed = len(spec.get("batches") or [spec["batch"]])
    if len(done) < fixed:
        return {"status": "timeout", "message": why + f" ({len(done)} of {fixed} phases finished)"}
    result: dict[str, Any] = {"status": OK, **{k: v for k, v in done[0].items() if k != "batch"},
                              "phases": done[:fixed], "device_memory_gib": None, "message": why}
    if spec.get("largest"):
        result["largest"] = dict(done[fixed], status=OK) if len(done) > fixed else {
            "status": "timeout", "batch": None, "fit": None, "message": why}
    return result


# --- sweeps --------------------------------------------------------------------------------------------------


def measure(name: str, model: dict, row_key: str, batch: int, args: argparse.Namespace, flops: float,
            batches: list[int] | None = None, plan: bool = False, largest: bool = False) -> dict:
    """One trial of ``row_key`` at ``batch`` (then ``batches[1:]``, then its largest batch with ``largest``),
    summarised per phase: median/min/max images/s over windows, TFLOP/s, MFU. Past ``--deadline`` the trial is
    not started: a row saying so instead."""
    left = args.deadline - time.time() if args.deadline else float("inf")
    if left < args.min_trial_seconds:
        result = dict(status="skipped", message=f"out of time ({max(left, 0):.0f} s left of --deadline)",
                      model=name, row=row_key, batch=batch)
    else:
        spec = dict(model=model, row=asdict(ROWS[row_key]), batch=batch, batches=batches or [batch], steps=args.steps,
                    windows=args.windows, warmup=args.warmup, device=args.device, fake_oom_above=args.fake_oom_above,
                    fake_memory=args.fake_memory, plan=plan, memory_cap_gib=args.memory_cap_gib)
        if largest:
            spec["largest"] = dict(memory_fraction=args.memory_fraction, granularity=args.search_granularity,
                                   limit=args.search_limit, **largest_timing(args))
        outcome = trial(spec) if args.in_process else run_trial(spec, min(args.timeout, left))
        result = dict(outcome, model=name, row=row_key, batch=batch)
    if result["status"] == OK:
        steps = args.steps
        for phase in result["phases"]:
            summarize_phase(phase, steps, flops, args.peak_flops)
        result.update({k: v for k, v in result["phases"][0].items() if k != "batch"})
        if result.get("largest", {}).get("status") == OK:
            summarize_phase(result["largest"], largest_timing(args)["steps"], flops, args.peak_flops)
    print(f"{name:9s} {row_key:12s} batch {batch:5d}: {short(result)}", flush=True)
    if getattr(args, "rows_log", None) is not None:  # every trial as it ends: a sweep cut short keeps its rows
        with open(args.rows_log, "a") as f:
            f.write(json.dumps(dict(result, table=args.table_name, stem=args.stem)) + "\n")
    return result


def largest_timing(args: argparse.Namespace) -> dict[str, int]:
    """The largest-batch phase's warm-up and windows (``--largest-steps``; its steps are long)."""
    warmup, steps, windows = args.largest_steps or (args.warmup, args.steps, args.windows)
    return dict(warmup=warmup, steps=steps, windows=windows)


def summarize_phase(phase: dict, steps: int, flops: float, peak_flops: float | None) -> None:
    from benchmarks.timing import rates, summarize

    spread = summarize(rates(phase["batch"], steps, phase["window_seconds"]))
    phase.update(images_per_sec=spread.median, low=spread.low, high=spread.high, windows=spread.n,
                 tflops=flops * spread.median / 1e12, mfu=mfu(flops, spread.median, peak_flops))


def short(r: dict) -> str:
    if r["status"] != OK:
        return f"{r['status']} ({r.get('message', '').splitlines()[0] if r.get('message') else ''})"
    parts = []
    for phase in [*r["phases"], *([r["largest"]] if r.get("largest") else [])]:
        if phase.get("status", OK) != OK:
            parts.append(f"batch {phase.get('batch')}: {phase['status']}")
            continue
        mem = "" if phase["peak_allocated_gib"] is None else f", peak {phase['peak_allocated_gib']:.2f} GiB"
        parts.append(f"batch {phase['batch']}: {phase['images_per_sec']:.1f} img/s"
                     f" [{phase['low']:.1f}-{phase['high']:.1f}]{mem}")
    return "; ".join(parts)


def same_batch_rows(models: dict, rows: list[str], args: argparse.Namespace, flops: dict) -> list[dict]:
    """Table 1 (phase 1 of each trial; with ``--second-batch``, phase 2 too). With ``--largest fit`` each trial
    goes on at its largest batch (table 2's first try), in the same process."""
    args.table_name = "same"
    fit_in_trial = "largest" in args.tables and args.largest == "fit"
    out = []
    for name, model in models.items():
        batch = args.batch or model["batch"]
        batches = [batch] + ([args.second_batch or 2 * batch] if args.second_batch is not None else [])
        out += [measure(name, model, key, batch, args, flops[name], batches,
                        largest=fit_in_trial and key in args.largest_rows) for key in rows]
    return out


def largest_batch_rows(models: dict, rows: list[str], args: argparse.Namespace, flops: dict) -> list[dict]:
    """``--largest search``: each row's largest batch by doubling and bisection, one trial per probe."""
    args.table_name = "largest"
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


def fitted_largest_rows(same: list[dict], args: argparse.Namespace, flops: dict, models: dict) -> list[dict]:
    """``--largest fit``: each row at the batch its same-batch trial's two peaks extrapolate to (tried in that
    trial), then in a fresh process 20% smaller after each out-of-memory (``--fit-retries``)."""
    args.table_name = "largest"
    out = []
    for r in same:
        name, key = r["model"], r["row"]
        if key not in args.largest_rows:
            continue
        first = r.get("largest")
        if r["status"] != OK or first is None or first.get("batch") is None:
            why = first.get("message", "") if first else r.get("message", r["status"])
            out.append(dict(status="no fit", model=name, row=key, batch=None, stopped_by="no fit", trials=[],
                            message=f"no largest-batch fit from the same-batch trial ({why})"))
            continue
        fit = first["fit"]
        trials = [(first["batch"], first["status"])]
        best = dict(first, model=name, row=key)
        batch = first["batch"]
        while best["status"] == OOM and len(trials) <= args.fit_retries:
            batch = step_down(batch, args.search_granularity)
            if batch < 1:
                break
            best = measure(name, models[name], key, batch, args, flops[name])
            trials.append((batch, best["status"]))
        stopped_by = fit["bound"] if best["status"] == OK and len(trials) == 1 else best["status"]
        if best["status"] == OK and len(trials) > 1:
            stopped_by = "oom above"
        out.append(dict(best, model=name, row=key, stopped_by=stopped_by, trials=trials,
                        predicted_largest=fit["unbounded"], fit_per_sample_gib=fit["per_sample_gib"],
                        fit_base_gib=fit["base_gib"]))
    return out


def ladder_rows(args: argparse.Namespace) -> list[dict]:
    """The largest ViT of the ladder that trains (kernels="auto", AC on) at ``--largest-batch``."""
    args.table_name = "ladder"
    out = []
    for name, model in (DRY_LADDER if args.dry_run else LADDER).items():
        flops = train_flops_per_sample(lambda model=model: build_vit(model), (3, model["image"], model["image"]))
        result = measure(name, model, "auto_ac1", args.largest_batch, args, flops)
        out.append(result)
        if result["status"] != OK:
            break
    return out


def planner_rows(args: argparse.Namespace) -> list[dict]:
    """The memory planner's predicted peak (``strategy.plan.predicted_peak``, from ``example_input_array``) next
    to ``torch.cuda.max_memory_allocated`` over the timed steps, per AC setting and batch, through Trainer.fit."""
    args.table_name = "planner"
    name, model = ("vit-dry", DRY_MODEL) if args.dry_run else (args.planner_model, MODELS[args.planner_model])
    flops = train_flops_per_sample(lambda: build_vit(model), (3, model["image"], model["image"]))
    return [measure(name, model, key, batch, args, flops, plan=True)
            for batch in args.planner_batches for key in args.planner_rows]


# --- reporting -----------------------------------------------------------------------------------------------


def same_batch_table(rows: list[dict], skipped: dict[str, str]) -> str:
    base = {(r["model"], r["row"]): r.get("images_per_sec") for r in rows}
    second = any(len(r.get("phases", [])) > 1 for r in rows)
    body = []
    for r in rows:
        ok = r["status"] == OK
        vs = [fmt(r["images_per_sec"] / b, ".2f", suffix="x") if ok and b else None
              for b in (base.get((r["model"], "single")), base.get((r["model"], "ddp")))]
        later = r["phases"][1] if ok and len(r["phases"]) > 1 else {}
        extra = [later.get("batch"), fmt(later.get("images_per_sec")), fmt(later.get("peak_allocated_gib"), ".2f")]
        body.append([
            r["model"], ROWS[r["row"]].label, r["batch"], fmt(r.get("images_per_sec")),
            f"{r['low']:.1f}-{r['high']:.1f} (n={r['windows']})" if ok else None,
            fmt(r.get("tflops")), fmt(r.get("mfu"), ".1f", 100, "%"), fmt(r.get("peak_allocated_gib"), ".2f"),
            *vs, *(extra if second else []), "ok" if ok else f"{r['status']}: {r.get('message', '')[:80]}",
        ])
    width = 13 if second else 10
    body += [["", ROWS[k].label, *[None] * (width - 2), note] for k, note in skipped.items()]
    headers = ["model", "row", "batch", "images/s (median)", "range over windows", "TFLOP/s", "MFU", "peak GiB",
               "vs single", "vs DDP", *(["2nd batch", "images/s", "peak GiB"] if second else []), "status"]
    return markdown_table(headers, body)


def largest_table(rows: list[dict]) -> str:
    base = {r["model"]: r.get("images_per_sec") for r in rows if r["row"] == "single" and r["status"] == OK}
    body = [[
        r["model"], ROWS[r["row"]].label, r.get("batch"), r["stopped_by"], r.get("predicted_largest"),
        fmt(r.get("images_per_sec")),
        fmt(r["images_per_sec"] / base[r["model"]], ".2f", suffix="x")
        if r["status"] == OK and base.get(r["model"]) else None,
        fmt(r.get("mfu"), ".1f", 100, "%"), fmt(r.get("peak_allocated_gib"), ".2f"),
        " ".join(f"{b}:{s}" for b, s in r["trials"]) or r.get("message", "")[:80],
    ] for r in rows]
    headers = ["model", "row", "largest batch", "bounded by", "fit's estimate", "images/s", "vs single", "MFU",
               "peak GiB", "trials"]
    return markdown_table(headers, body)


def planner_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        predicted, measured = r.get("predicted_peak_gib"), r.get("peak_allocated_gib")
        ratio = fmt(predicted / measured, ".3f") if predicted and measured else None
        body.append([r["model"], ROWS[r["row"]].label, r["batch"], fmt(predicted, ".2f"), fmt(measured, ".2f"), ratio,
                     r.get("checkpointed_blocks"), r.get("blocks_per_unit"),
                     "ok" if r["status"] == OK else f"{r['status']}: {r.get('message', '')[:80]}"])
    headers = ["model", "row", "batch", "predicted peak GiB", "max_memory_allocated GiB", "predicted / measured",
               "checkpointed blocks", "blocks per unit", "status"]
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
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=TABLE_ROWS)
    p.add_argument("--tables", nargs="+", choices=("same", "largest"), default=["same", "largest"])
    p.add_argument("--batch", type=int, help="table 1 batch for every model (default: per model, see MODELS)")
    p.add_argument("--steps", type=int, default=10, help="steps per timing window")
    p.add_argument("--windows", type=int, default=5, help="timing windows (>= 3 for a median and a range)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, attention choice)")
    p.add_argument("--second-batch", type=int, help="go on at this batch in the same trial (0: twice --batch);"
                   " default: only with --largest fit")
    p.add_argument("--largest", choices=("fit", "search"), default="fit",
                   help="table 2: extrapolate two measured peaks (one trial per row) or bisect (several)")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="--largest fit: peak to aim for, of the"
                   " device's memory")
    p.add_argument("--memory-cap-gib", type=float, help="each trial's process may allocate this much of the GPU"
                   " (torch.cuda.set_per_process_memory_fraction; the planner plans for it too): 40 is an A100-40GB")
    p.add_argument("--fit-retries", type=int, default=2, help="--largest fit: 20%% smaller tries after an OOM")
    p.add_argument("--largest-steps", type=int, nargs=3, metavar=("WARMUP", "STEPS", "WINDOWS"),
                   help="--largest fit: the largest-batch phase's timing (default: --warmup, --steps, --windows)")
    p.add_argument("--largest-rows", nargs="+", choices=list(ROWS), help="rows that get a largest batch"
                   " (default: every row but auto_acplan, whose planner re-plans for each batch)")
    p.add_argument("--search-start", type=int, default=16)
    p.add_argument("--search-limit", type=int, default=1024, help="largest batch tried (both methods)")
    p.add_argument("--search-granularity", type=int, default=8,
                   help="batches are multiples of this (--largest fit); stop bisecting when bounds are this close")
    p.add_argument("--search-largest", action="store_true", help="instead of the tables: the largest ViT that trains")
    p.add_argument("--largest-batch", type=int, default=8)
    p.add_argument("--planner", action="store_true", help="instead of the tables: the planner's predicted peak"
                   " against max_memory_allocated (AC off / full / auto, kernels='eager')")
    p.add_argument("--planner-model", choices=list(MODELS), default="vit-l16")
    p.add_argument("--planner-batches", nargs="+", type=int, default=[32, 64])
    p.add_argument("--planner-rows", nargs="+", choices=list(ROWS), default=PLANNER_ROWS)
    p.add_argument("--deadline", type=float, help="Unix time: trials that would start later are rows saying so,"
                   " and a trial's timeout never runs past it")
    p.add_argument("--min-trial-seconds", type=float, default=20, help="no trial starts with less time left")
    p.add_argument("--stem", help="output file names' stem (default: from the mode and models)")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s for MFU (default: the GPU's dense bf16 peak)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per trial")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny ViT on CPU, 3 windows of 1 step, simulated device memory and out-of-memory above batch 6")
    p.add_argument("--fake-oom-above", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fake-memory", type=float, nargs=3, help=argparse.SUPPRESS)  # base, per sample, total GiB
    p.add_argument("--in-process", action="store_true", help="no subprocess per trial (the dry run's default:"
                   " a CPU trial leaves no allocator state behind)")
    p.add_argument("--write-results", action="store_true",
                   help="append the tables to OUT_DIR/RESULTS.md and plot table 1 to OUT_DIR/vit_gpu_<models>.png")
    p.add_argument("--out-dir", type=Path, help="default: benchmarks/ (dry run: /tmp/vit_gpu_dry_run)")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    return p.parse_args()


def configure(args: argparse.Namespace) -> str:
    """Settings that follow from others (the dry run's tiny shapes, the fit's second batch); returns the device."""
    import torch

    from lightning_vitscale.monitoring.throughput import device_peak_flops

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("benchmarks/vit_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "`--dry-run` checks every row on CPU.")
    if args.dry_run:
        args.steps, args.windows, args.warmup, args.largest_batch = 1, 3, 1, 2
        args.batch, args.second_batch = 2, 3  # tiny shapes whatever the GPU command line says
        args.planner_batches = [2, 3]
        args.search_start, args.search_limit, args.search_granularity = 2, 16, 1
        args.largest_steps = None
        args.fake_oom_above = 6 if args.fake_oom_above is None else args.fake_oom_above
        if not args.planner:  # the planner's cells compare against a real allocator peak: none on CPU
            args.fake_memory = args.fake_memory or [1.0, 0.25, 4.0]  # the fit aims at 10, out of memory above 6
        args.in_process = True
    if "largest" in args.tables and args.largest == "fit" and args.second_batch is None:
        args.second_batch = 0
    args.largest_rows = args.largest_rows or [key for key in args.rows if key != "auto_acplan"]
    args.device = "cpu" if args.dry_run else "cuda"
    args.peak_flops = args.peak_flops or device_peak_flops(torch.device(args.device))
    mode = ("largest_vit" if args.search_largest else "planner" if args.planner
            else "_".join(["dry"] if args.dry_run else args.models))
    args.stem = args.stem or "vit_gpu_" + mode
    return torch.cuda.get_device_name() if not args.dry_run else (
        f"CPU (dry run: tiny ViT, simulated memory and out-of-memory above batch {args.fake_oom_above})")


def tables(args: argparse.Namespace, report: list[str]) -> dict[str, Any]:
    """Table 1 (same batch) and table 2 (largest batch) for ``--models``; appends their text to ``report``."""
    rows, skipped = list(args.rows), {}
    if "auto_acplan" in rows and (why := planner_available()) is not None:
        rows.remove("auto_acplan")
        skipped["auto_acplan"] = why
    models = {"vit-dry": DRY_MODEL} if args.dry_run else {k: MODELS[k] for k in args.models}
    flops = {name: train_flops_per_sample(lambda m=m: build_vit(m), (3, m["image"], m["image"]))
             for name, m in models.items()}
    results: dict[str, Any] = {"flops_per_image": flops, "skipped": skipped}
    report.append("Model FLOPs per image (3 x forward): "
                  + ", ".join(f"{name} {f / 1e9:.4g} GFLOP" for name, f in flops.items()) + "\n")
    same: list[dict] = []
    if "same" in args.tables or args.largest == "fit":
        same = results["same"] = same_batch_rows(models, rows, args, flops)
        report.append("Same batch for every row:\n\n" + same_batch_table(same, skipped))
    if "largest" in args.tables:
        if args.largest == "fit":
            results["largest"] = fitted_largest_rows(same, args, flops, models)
            how = (f"peaks at two batches extrapolated to {args.memory_fraction:.0%} of the device's memory,"
                   f" at most {args.search_limit}, then 20% smaller after an out-of-memory")
        else:
            results["largest"] = largest_batch_rows(models, args.largest_rows, args, flops)
            how = "binary search"
        report.append(f"Each row at its largest batch ({how}):\n\n" + largest_table(results["largest"]))
    return results


def main() -> None:
    args = parse_args()
    if args.trial:
        print("RESULT " + json.dumps(trial(json.loads(args.trial))), flush=True)
        return
    device = configure(args)
    out = args.out_dir or (Path("/tmp/vit_gpu_dry_run") if args.dry_run else HERE)
    out.mkdir(parents=True, exist_ok=True)
    args.rows_log = out / "vit_gpu_trials.jsonl"
    report = [header(args, device)]
    if args.search_largest:
        ladder = ladder_rows(args)
        report.append("Largest ViT that trains (VitScale auto, AC on, batch"
                      f" {args.largest_batch}):\n\n" + ladder_table(ladder))
        results: dict[str, Any] = {"ladder": ladder}
    elif args.planner:
        results = {"planner": planner_rows(args)}
        report.append("The planner's predicted peak against torch.cuda.max_memory_allocated (Trainer.fit,"
                      " example_input_array set, kernels='eager'):\n\n" + planner_table(results["planner"]))
    else:
        results = tables(args, report)
    (out / f"{args.stem}.json").write_text(json.dumps(dict(device=device, **results), indent=1))
    text = "\n".join(report)
    print("\n" + text)
    if args.write_results:
        if "same" in results:
            plot(results["same"], out / f"{args.stem}.png")
            text += f"\n![images/s per row]({args.stem}.png)\n"
        with open(out / "RESULTS.md", "a") as f:
            f.write("\n" + text)
        print(f"appended to {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
