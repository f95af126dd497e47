"""Where a training step's time goes on CPU ranks: DDP against each VitScaleStrategy setting, in one launch.

Usage::

    python benchmarks/step_breakdown.py                     # the 6-block dim-256 ViT (fp32, batch 8, 64 tokens)
    python benchmarks/step_breakdown.py --model timm        # timm's vit_tiny_patch16_224 at 32 px, patch 4
    python benchmarks/step_breakdown.py --steps 30 --json out.json

One launch (torch's elastic launcher, gloo, one thread per rank) builds every variant from the same seed and
times them interleaved, step by step (zero_grad -> forward -> backward -> AdamW step): median of ``--steps``
steps after ``--warmup``, slowest rank. Then one more step per variant under ``torch.profiler``, split on the
step's own thread into:

* compute: self time of the ``aten::`` ops of forward, backward and the optimizer;
* recompute: those run again in backward by checkpointed blocks (labelled here: a block's inner forward called
  while autograd runs a backward);
* sharding copies: ``aten::`` ops inside FSDP2's own ranges (all-gather copy-in/out, gradient chunking);
* collectives: time the step's thread spent inside ``c10d::`` calls (issuing and blocking on all-gathers and
  reduce-scatters). DDP's all-reduces run on gloo's threads; its reducer waits for them inside C++ at the end of
  backward, which the profiler does not label: that wait lands in "other";
* other: the rest of the profiled step: Python, FSDP/DDP hooks, DTensor dispatch, unlabelled waits.

Three profiled steps per variant, median of each part; profiled steps run slower than the timed ones (profiler
overhead): compare their parts with each other.
Accumulation rows time one optimizer step of 4 micro-batches and count FSDP2's reduce-scatters in it. Memory
rows: host memory held after one forward of a batch of 64 on one process, per checkpointing mode.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (activation checkpointing, reshard_after_forward, prefetch, blocks_per_unit). "kept" = blocks stay
# gathered from forward to backward (`reshard_after_forward=False`), otherwise the recipe (blocks reshard);
# "1/unit" = one block per FSDP unit (what main ran before the planner chose units). `None` prefetch = the
# default (1 on CPU, with the collectives asynchronous); `None` blocks_per_unit = the planner's choice, as
# `VitScaleStrategy` makes it at setup with `example_input_array` set: for the checkpointing given, or, for
# "auto", with the checkpointing and reshard per block (budget: 0.9 of the host's available memory per rank,
# i.e. ample here). A name ending in ", sync" is built the same, then given back FSDP2's own synchronous
# collectives and no explicit prefetch: the setting before the CPU overlap (sharding/cpu_overlap.py).
VARIANTS: dict[str, tuple[bool | str, bool | None, int | None, int | None]] = {
    "off, 1/unit": (False, None, None, 1),
    "off kept, 1/unit, sync": (False, False, 0, 1),
    "off kept, 1/unit": (False, False, None, 1),
    "off kept, 2/unit": (False, False, None, 2),
    "off kept, 3/unit, sync": (False, False, 0, 3),
    "off kept, 3/unit": (False, False, None, 3),
    "auto (planner)": ("auto", None, None, None),
    "selective kept, 1/unit": ("selective", False, None, 1),
    "selective kept (planner's units)": ("selective", False, None, None),
    "full, 1/unit (recipe), sync": (True, None, 0, 1),
    "full, 1/unit (recipe)": (True, None, None, 1),
    "full, 2/unit": (True, None, None, 2),
    "full, 3/unit, sync": (True, None, 0, 3),
    "full, 3/unit": (True, None, None, 3),
    "full (planner's units)": (True, None, None, None),
    "full kept (planner's units)": (True, False, None, None),
}
ACCUMULATION = ("ddp accum4", "sharded accum4", "unsharded accum4")
MICRO_BATCHES = 4


def make_model(name: str):
    import torch

    torch.manual_seed(0)
    if name == "timm":
        import timm

        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10)
    from lightning_vitscale.cli.demo import TinyViT

    return TinyViT(image=32, patch=4, dim=256, depth=6)


def build(model_name: str, variant: str, x):
    """The model under DDP or the strategy's setup for ``variant``; the planner's choice in words (or "")."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_vitscale.distributed import RankContext
    from lightning_vitscale.kernels.optimizers import prefer_foreach
    from lightning_vitscale.precision.settings import resolve_flag
    from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig, ShardingPolicy
    from lightning_vitscale.sharding.outer_unit import OuterUnit
    from lightning_vitscale.sharding.parallelize import parallelize
    from lightning_vitscale.sharding.planning import agreed_budget, plan_before_sharding
    from lightning_vitscale.sharding.resolved import resolve_config

    model = make_model(model_name)
    chosen = ""
    if variant.startswith("ddp"):
        root = DistributedDataParallel(model)
    else:
        # accumulation rows: blocks kept gathered, one block per unit, the default prefetch
        ac, reshard, prefetch, per_unit = VARIANTS.get(variant, (False, False, None, 1))
        root = OuterUnit(model)
        model.example_input_array = x  # the batch known at setup: the planner may choose
        world, cpu = dist.get_world_size(), torch.device("cpu")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
        config = ParallelConfig(sharding=ShardingPolicy(reshard_after_forward=reshard, prefetch=prefetch,
                                                        blocks_per_unit=per_unit),
                                checkpointing=CheckpointingPolicy(blocks=ac),
                                priority="speed" if per_unit is None else "memory")  # rows with units: as named
        ranks = RankContext(mesh, cpu, dist.get_rank(), world, agree_max=_agree_max, world_size=world)
        budget = agreed_budget(config.checkpointing.memory_budget, ranks)
        planned = plan_before_sharding(model, resolve_config(config, cpu), resolve_flag("32-true"), ranks, budget)
        done = parallelize(root, model, mesh, planned.resolved, resolve_flag("32-true"), cpu)
        planned.apply(model, done.plan, cpu)
        if variant.endswith(", sync"):
            synchronous_collectives(root)
        if per_unit is None:
            why = done.plan.memory if ac == "auto" else done.plan.units_choice
            chosen = f"{done.plan.units - 1} block units; {why}"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prefer_foreach([optimizer])
    return root, optimizer, chosen


def synchronous_collectives(root) -> None:
    """FSDP2's own collectives again on every unit of ``root``: the reduce-scatter the step's thread waits for and
    all-gathers issued synchronously (torch internals: a benchmark-only way back to the setting before)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(DefaultReduceScatter())
            module._set_unshard_async_op(False)


def _agree_max(value: int) -> int:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(value)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def no_sync_for(variant: str, root) -> Callable[[], object]:
    """What Lightning's ``block_backward_sync`` enters for micro-batches before the last, per accumulation row."""
    from lightning_vitscale.sharding.gradient_sync import gradient_sync_off

    if variant == "ddp accum4":
        return root.no_sync
    if variant == "unsharded accum4":
        return lambda: gradient_sync_off(root)
    return nullcontext


def step_fn(variant: str, root, optimizer, x, y, optimizer_times: list[float]) -> Callable[[], None]:
    """One training step; the optimizer step's own time is appended to ``optimizer_times``."""
    import torch.nn.functional as F

    micro = MICRO_BATCHES if variant in ACCUMULATION else 1
    no_sync = no_sync_for(variant, root) if micro > 1 else nullcontext

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for i in range(micro):
            with no_sync() if i < micro - 1 else nullcontext():
                F.cross_entropy(root(x), y).backward()
        start = time.perf_counter()
        optimizer.step()
        optimizer_times.append(time.perf_counter() - start)

    return step


def label_recompute(model) -> None:
    """Mark recomputation for the profiler: a checkpointed block's inner forward that runs during backward."""
    import functools

    import torch

    from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode

    def labelled(forward, *args, **kwargs):
        if torch._C._current_graph_task_id() == -1:  # not inside backward: the first forward
            return forward(*args, **kwargs)
        with torch._C._profiler._RecordFunctionFast("recompute"):  # not a dispatched op: SAC stays valid
            return forward(*args, **kwargs)

    for block in model.blocks:
        if checkpoint_mode(block) is not None:
            patched = block.forward  # functools.partial(_checkpointed_forward, inner forward, mode)
            inner = functools.partial(labelled, patched.args[0])
            block.forward = functools.partial(patched.func, inner, *patched.args[1:])


def breakdown(step: Callable[[], None], repeats: int) -> dict[str, float]:
    """``repeats`` steps under the profiler, each split on the step's thread; the median of each part (ms)."""
    parts = [_profiled(step) for _ in range(repeats)]
    return {key: statistics.median(p[key] for p in parts) for key in parts[0]}


def _profiled(step: Callable[[], None]) -> dict[str, float]:
    from collections import Counter

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        step()
        total = 1e3 * (time.perf_counter() - t)
    # The step's own thread runs almost every event; gloo's worker threads run the collectives' bodies.
    main = Counter(e.thread for e in prof.events()).most_common(1)[0][0]
    events = [e for e in prof.events() if e.thread == main]
    sums = Counter()
    for e in events:
        if e.name.startswith("c10d::"):
            sums["collectives"] += e.cpu_time_total
        elif e.name.startswith("aten::") and not _under(e, ("c10d::",)):
            kind = "recompute" if _under(e, ("recompute",)) else "sharding copies" if _under(e, ("FSDP::",)) else (
                "compute")
            sums[kind] += e.self_cpu_time_total
    out = {key: sums[key] / 1e3 for key in ("compute", "recompute", "sharding copies", "collectives")}
    out["other"] = total - sum(out.values())
    out["profiled"] = total
    return out


def _under(event, prefixes: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False


def count_reduce_scatters(step: Callable[[], None]) -> int:
    import torch.distributed as dist

    calls = [0]
    from lightning_vitscale._compat import REDUCE_SCATTER

    original = getattr(dist, REDUCE_SCATTER)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(dist, REDUCE_SCATTER, counted)
    try:
        step()
    finally:
        setattr(dist, REDUCE_SCATTER, original)
    return calls[0]


def worker(out: str, model_name: str, steps: int, warmup: int, accum_steps: int, only: str = "") -> None:
    import os
    import resource

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    names = ["ddp", *VARIANTS, *ACCUMULATION]
    if only:
        names = ["ddp", *only.split(";")]
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    steps_of = {}
    optimizer_times: dict[str, list[float]] = {n: [] for n in names}
    chosen: dict[str, str] = {}
    for name in names:
        root, optimizer, chosen[name] = build(model_name, name, x)
        if not name.startswith("ddp"):
            label_recompute(root.module)
        steps_of[name] = step_fn(name, root, optimizer, x, y, optimizer_times[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}  # minor page faults: fresh pages the step touched
    for index in range(warmup + steps):
        for name in names:
            if name in ACCUMULATION and index >= warmup + accum_steps:
                continue
            dist.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            steps_of[name]()
            if index >= warmup:
                times[name].append(time.perf_counter() - t)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    result: dict[str, dict[str, float]] = {
        n: {"median": 1e3 * statistics.median(t), "optimizer": 1e3 * statistics.median(optimizer_times[n][warmup:]),
            "page_faults": statistics.median(faults[n])}
        for n, t in times.items()
    }
    for name in names:
        dist.barrier()
        result[name].update(breakdown(steps_of[name], repeats=3))
        result[name]["chosen"] = chosen[name]  # type: ignore[assignment]
        if name in ACCUMULATION:
            dist.barrier()
            result[name]["reduce_scatters"] = count_reduce_scatters(steps_of[name])
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def held_after_forward(model_name: str) -> dict[str, float]:
    """Host memory (MiB) held after one forward of a batch of 64 on one process, per checkpointing mode."""
    import torch

    from lightning_vitscale.sharding.activation_checkpointing import apply_activation_checkpointing

    libc = ctypes.CDLL("libc.so.6")
    x = torch.randn(64, 3, 32, 32)
    held = {}
    for mode in ("none", "selective", "full"):
        model = make_model(model_name)
        blocks = list(model.blocks)
        if mode != "none":
            apply_activation_checkpointing(blocks, mode)  # type: ignore[arg-type]
        model(x).sum().backward()  # warm the allocator's pools once
        model.zero_grad(set_to_none=True)
        libc.malloc_trim(0)
        before = _rss()
        loss = model(x).sum()
        held[mode] = (_rss() - before) / 2**20
        loss.backward()
        del loss
    return held


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def report(merged: dict[str, dict[str, float]], held: dict[str, float]) -> str:
    ddp = merged["ddp"]["median"]
    parts = ("compute", "recompute", "sharding copies", "collectives", "other")
    lines = ["| variant | median ms/step | / DDP | optimizer step | page faults/step | profiled step (ms): "
             + " | ".join(parts) + " |", "|---|---|---|---|---|" + "---|" * len(parts)]
    for name, row in merged.items():
        if name in ACCUMULATION:
            continue
        cells = " | ".join(f"{row[p]:.1f}" for p in parts)
        ratio = row["median"] / ddp
        lines.append(f"| {name} | {row['median']:.1f} | {ratio:.2f}x | {row['optimizer']:.1f} |"
                     f" {row['page_faults']:.0f} | {cells} |")
    lines += ["", f"| accumulation ({MICRO_BATCHES} micro-batches) | median ms/optimizer step | / DDP |"
              " reduce-scatters per optimizer step |", "|---|---|---|---|"]
    for name in (n for n in ACCUMULATION if n in merged):
        row = merged[name]
        lines.append(f"| {name} | {row['median']:.1f} | {row['median'] / merged[ACCUMULATION[0]]['median']:.2f}x |"
                     f" {int(row.get('reduce_scatters', 0))} |")
    lines += ["", "| variant | the planner's choice |", "|---|---|"]
    lines += [f"| {name} | {row['chosen']} |" for name, row in merged.items() if row.get("chosen")]
    lines += ["", "| checkpointing | held after forward, batch 64 (MiB) |", "|---|---|"]
    lines += [f"| {mode} | {mib:.1f} |" for mode, mib in held.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("vit", "timm"), default="vit")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--accum-steps", type=int, default=8, help="timed optimizer steps of the accumulation rows")
    parser.add_argument("--json", help="also write the merged numbers here")
    parser.add_argument("--only", default="", help="variants to time besides ddp, separated by ';' (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.steps, args.warmup, args.accum_steps, args.only)
        return
    from tests.helpers.launch import assert_ok, torchrun

    with tempfile.TemporaryDirectory() as out:
        assert_ok(torchrun(Path(__file__), "--worker", out, "--model", args.model, "--steps", str(args.steps),
                           "--warmup", str(args.warmup), "--accum-steps", str(args.accum_steps), "--only", args.only,
                           nprocs=args.ranks, timeout=600))
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    # Slowest rank per variant (its median), and that rank's profiled breakdown.
    merged = {name: max((r[name] for r in ranks), key=lambda row: row["median"]) for name in ranks[0]}
    held = held_after_forward(args.model)
    print(report(merged, held))
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": merged, "held_after_forward_mib": held}, indent=1))


if __name__ == "__main__":
    main()
