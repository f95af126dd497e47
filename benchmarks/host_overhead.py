"""Host time per training step: what the strategy costs the CPU that drives the accelerator.

Usage::

    python benchmarks/host_overhead.py                       # CPU, 5 rounds
    python benchmarks/host_overhead.py --accelerator cuda    # on a GPU machine: the host that feeds the GPU
    python benchmarks/host_overhead.py --rounds 8 --json out.json
    python benchmarks/host_overhead.py --variants "single AMP O1" "off, 1 block/unit, resharded"
    python benchmarks/host_overhead.py --dry-run              # 1 round of 2 steps on CPU (gpu_run.sh's dry run)
    python benchmarks/host_overhead.py --time-calls           # also each call of the one-rank step's own parts

On a GPU a step is host-bound when the host takes longer to issue its kernels than the GPU takes to run them (ViT-H
at batch 32 in RESULTS.md's GPU runs). This script measures that host time alone: ViT-H's structure (32 blocks,
65 norms, 390 parameters) with tiny widths (dim 64, 4 tokens, batch 2), so the arithmetic is negligible and a step
is the host's work: the strategy's hooks, casts, DTensor dispatch, the optimizer. ``Trainer.fit`` on one device,
``precision="bf16-mixed"``, AdamW; variants interleaved round by round in one process (one thread): plain
single-device AMP O1 (``strategy="auto"``), ``VitScaleStrategy(activation_checkpointing=False)`` and
``VitScaleStrategy()`` (the planner's speed-first plan: here the blocks in the outer unit, nothing checkpointed),
and checkpointing off with the optimizer stepping per tensor (without ``precision/flat_step.py``'s flat groups).
Every variant runs on one intra-op thread: ``OMP_NUM_THREADS=1`` is set before any fit, or Lightning's launcher (a
``strategy="ddp"`` run's too) sets ``torch.set_num_threads(cpus // processes)`` for the strategies and not for
``strategy="auto"``, and the strategies' tiny kernels pay for a second thread's synchronization (before 2026-12-03 they
did: 2 threads against plain AMP's 1 on this 2-core machine). On CPU, AdamW's default is its per-tensor loop, on a
GPU its foreach step (the strategies pick foreach everywhere): "single AMP O1, foreach AdamW" is plain AMP O1 as a
GPU user runs it, the stricter reference for host work (not timed by default on a GPU, where it is plain AMP O1).
Each fit's steps after ``--warmup`` are timed from ``on_train_batch_start`` to ``on_train_batch_end``; median over
every round.
Variants pinning ``blocks_per_unit`` (1 and 8, with and without checkpointing) show the per-unit cost whatever
grouping the planner picks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import lightning as L
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> VitScaleStrategy's keyword arguments (None: plain single-device AMP O1, strategy="auto"; FOREACH_AMP's
# AdamW takes foreach=True, a GPU's default). The pinned layouts show the per-unit cost whatever the planner picks:
# the recipe's one block per unit resharded after forward, and 8 blocks per unit kept gathered from forward to
# backward.
_ONE = {"blocks_per_unit": 1, "reshard_after_forward": True}
_EIGHT = {"blocks_per_unit": 8, "reshard_after_forward": False}
FOREACH_AMP = "single AMP O1, foreach AdamW"
# Checkpointing off with the optimizer stepping each parameter's tensor, as before flat groups
# (precision/flat_step.py): what the flat step saves, in the same run.
PER_TENSOR = "VitScaleStrategy(activation_checkpointing=False), per-tensor step"
STRATEGIES: dict[str, dict | None] = {
    "single AMP O1": None,
    FOREACH_AMP: None,
    "VitScaleStrategy(activation_checkpointing=False)": {"activation_checkpointing": False},
    PER_TENSOR: {"activation_checkpointing": False},
    "VitScaleStrategy()": {},
    "off, 1 block/unit, resharded": {"activation_checkpointing": False, **_ONE},
    "off, 8 blocks/unit, kept gathered": {"activation_checkpointing": False, **_EIGHT},
    "checkpointed, 1 block/unit, resharded": {"activation_checkpointing": True, **_ONE},
    "checkpointed, 8 blocks/unit, kept gathered": {"activation_checkpointing": True, **_EIGHT},
}
# `VitScaleStrategy()` fed batches from an IterableDataset, as streamed data (tar shards) or GPU run 5's benchmark:
# setup reads no batch, so the plan waits for the first step. BEFORE_ONE_UNIT: the same with one unit per block, as
# one rank got it before 902fbdc (what made run 5's ViT-B/16 step host-bound).
STREAMED = "VitScaleStrategy(), streamed data"
BEFORE_ONE_UNIT = "VitScaleStrategy(), streamed data, a unit per block (before 902fbdc)"
STRATEGIES |= {STREAMED: {}, BEFORE_ONE_UNIT: {}}
VARIANTS = tuple(STRATEGIES)


class HugeShape(L.LightningModule):
    """ViT-H/14's depth and layer count at width 64: every hook, cast and parameter of a ViT-H step, no FLOPs."""

    def __init__(self, foreach: bool | None = None) -> None:
        super().__init__()
        self.foreach = foreach
        from timm.models.vision_transformer import VisionTransformer

        self.net = VisionTransformer(img_size=28, patch_size=14, embed_dim=64, depth=32, num_heads=4, num_classes=8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=self.foreach)


class StepTimer(L.Callback):
    """Wall time and this thread's CPU time of each step: on CPU the latter is the host's work alone, whatever else
    shares the cores (on a GPU it also counts the spin of the synchronizing wait)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.cpu_seconds, self.start, self.cpu_start = device, [], [], 0.0, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, *args) -> None:
        self._sync()
        self.start, self.cpu_start = time.perf_counter(), time.thread_time()

    def on_train_batch_end(self, *args) -> None:
        self._sync()
        self.seconds.append(time.perf_counter() - self.start)
        self.cpu_seconds.append(time.thread_time() - self.cpu_start)


class CallTimer:
    """This thread's CPU time in each call of the one-rank step's own parts (``--time-calls``): the optimizer
    section (the swap to local tensors and back, the non-finite check, the step, as ``precision/plugin.py`` runs
    it) and the gradient hand-over at the end of each backward (``sharding/compute_copies.py``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {"optimizer section": [], "gradient hand-over": []}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from lightning_vitscale.precision import plugin
        from lightning_vitscale.sharding.compute_copies import ComputeCopies

        section, hand_over = plugin.on_local_shards, ComputeCopies.hand_over_gradients
        record = self.seconds

        @contextlib.contextmanager
        def timed_section(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
            start = time.thread_time()
            with section(optimizer) as swapped:
                yield swapped
            record["optimizer section"].append(time.thread_time() - start)

        def timed_hand_over(copies: ComputeCopies) -> None:
            start = time.thread_time()
            hand_over(copies)
            record["gradient hand-over"].append(time.thread_time() - start)

        with mock.patch.object(plugin, "on_local_shards", timed_section), \
                mock.patch.object(ComputeCopies, "hand_over_gradients", timed_hand_over):
            yield


class _Streamed(torch.utils.data.IterableDataset):
    """``dataset`` in batches of ``batch_size``, streamed: a ``DataLoader`` over it gives setup no batch."""

    def __init__(self, dataset: torch.utils.data.TensorDataset, batch_size: int) -> None:
        self.tensors, self.batch_size = dataset.tensors, batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for start in range(0, len(self.tensors[0]), self.batch_size):
            yield tuple(t[start:start + self.batch_size] for t in self.tensors)


def fit_times(variant: str, accelerator: str, steps: int, warmup: int,
              calls: CallTimer | None = None) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each step after ``warmup`` of one fit of ``variant``."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_vitscale import VitScaleStrategy

    kwargs = STRATEGIES[variant]
    strategy = "auto" if kwargs is None else VitScaleStrategy(**kwargs)
    L.seed_everything(0, verbose=False)
    n = 2 * (steps + warmup)
    data = TensorDataset(torch.randn(n, 3, 28, 28), torch.randint(0, 8, (n,)))
    device = torch.device("cuda" if accelerator == "cuda" else "cpu")
    timer = StepTimer(device)
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=steps + warmup, callbacks=[timer], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    from lightning_vitscale.precision import flat_step
    from lightning_vitscale.sharding import planning

    no_flat_groups = mock.patch.object(flat_step, "lay_out", lambda optimizers, eligible: [])
    units_per_block = mock.patch.object(planning, "one_rank_keeps", lambda *args: None)
    loader = DataLoader(data, batch_size=2)
    if variant in (STREAMED, BEFORE_ONE_UNIT):
        loader = DataLoader(_Streamed(data, 2), batch_size=None)
    timed = CallTimer()
    with no_flat_groups if variant == PER_TENSOR else contextlib.nullcontext(), \
            units_per_block if variant == BEFORE_ONE_UNIT else contextlib.nullcontext(), \
            timed.installed() if calls is not None else contextlib.nullcontext():
        trainer.fit(HugeShape(foreach=True if variant == FOREACH_AMP else None), loader)
    if calls is not None:
        for name, seconds in timed.seconds.items():
            calls.seconds[name] += seconds[warmup:]
    return timer.seconds[warmup:], timer.cpu_seconds[warmup:]


def table(result: dict) -> str:
    """The Markdown table of one run's ``--json`` (also gpu_report.py's); with the foreach reference timed, a last
    column of CPU time over it."""
    ms, cpu = result["ms_per_step"], result.get("cpu_ms_per_step")  # no CPU times in runs before 2026-12
    single = ms[VARIANTS[0]]
    foreach = cpu.get(FOREACH_AMP) if cpu else None
    header = f"| variant ({result['accelerator']}, {result['rounds']} rounds) | host ms/step | / single |"
    header += (" CPU ms/step | / single |" if cpu else "") + (" / foreach AMP |" if foreach else "")
    lines = [header, "|---|---|---|" + ("---|---|" if cpu else "") + ("---|" if foreach else "")]
    for variant, value in ms.items():
        row = f"| {variant} | {value:.1f} | {value / single:.2f}x |"
        row += f" {cpu[variant]:.1f} | {cpu[variant] / cpu[VARIANTS[0]]:.2f}x |" if cpu else ""
        lines.append(row + (f" {cpu[variant] / foreach:.2f}x |" if foreach else ""))
    return "\n".join(lines) + "\n"


def round_ratios(result: dict) -> str:
    """Each variant's CPU time over plain AMP O1's in the same round, median over rounds: the steal time of a shared
    machine moves whole fits by +-20%, and a round's fits run back to back."""
    per_round = {v: [statistics.median(steps) for steps in fits] for v, fits in result["cpu_ms_steps"].items()}
    single = per_round[VARIANTS[0]]
    lines = []
    for variant, values in per_round.items():
        ratios = [v / s for v, s in zip(values, single)]
        lines.append(f"{variant}: median per-round ratio {statistics.median(ratios):.2f}x"
                     f" ({', '.join(f'{r:.2f}' for r in ratios)})")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each fit")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), metavar="NAME",
                        help=f"which variants to time (default: all of {', '.join(VARIANTS)})")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--time-calls", action="store_true",
                        help="also time the one-rank step's optimizer section and gradient hand-over per call"
                             " (this thread's CPU time: on a GPU it includes a synchronizing wait's spin)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, one round of 2 steps: checks the script")
    args = parser.parse_args()
    if args.dry_run:
        args.accelerator, args.rounds, args.steps, args.warmup = "cpu", 1, 2, 1
    os.environ["OMP_NUM_THREADS"] = "1"  # Lightning's launcher then leaves the one thread alone (module docstring)
    torch.set_num_threads(1)
    variants = [v for v in VARIANTS if v in args.variants]
    if args.accelerator == "cuda" and args.variants == list(VARIANTS):
        variants.remove(FOREACH_AMP)  # AdamW's default on a GPU is its foreach step: plain AMP O1 already
        variants.remove(PER_TENSOR)  # gpu_run.sh's minute for this part: named with --variants when wanted
        variants.remove(BEFORE_ONE_UNIT)
    if VARIANTS[0] not in variants:
        parser.error(f"--variants must include {VARIANTS[0]!r}: every ratio is to it")
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu_times: dict[str, list[float]] = {v: [] for v in variants}
    rounds: dict[str, list[list[float]]] = {v: [] for v in variants}  # each fit's CPU ms per timed step
    calls = {v: CallTimer() for v in variants} if args.time_calls else {}
    for r in range(args.rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            wall, cpu = fit_times(variant, args.accelerator, args.steps, args.warmup, calls.get(variant))
            times[variant] += wall
            cpu_times[variant] += cpu
            rounds[variant].append([round(1e3 * c, 3) for c in cpu])
    result = {"accelerator": args.accelerator, "rounds": args.rounds,
              "ms_per_step": {v: 1e3 * statistics.median(t) for v, t in times.items()},
              "cpu_ms_per_step": {v: 1e3 * statistics.median(t) for v, t in cpu_times.items()},
              "cpu_ms_steps": rounds}
    if calls:
        result["cpu_ms_per_call"] = {v: {name: 1e3 * statistics.median(t) for name, t in timer.seconds.items() if t}
                                     for v, timer in calls.items()}
    print(table(result))
    print(round_ratios(result))
    for variant, parts in result.get("cpu_ms_per_call", {}).items():
        if parts:
            print(f"{variant}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in parts.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
