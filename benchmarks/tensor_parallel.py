"""Step time, per-rank state and bytes per step per mesh dimension of tensor parallelism beside FSDP against FSDP
alone and DDP, on 4 CPU ranks.

The examples' ViT (fp32, no activation checkpointing) at the same global batch through ``Trainer.fit``: DDP,
``VitScaleStrategy()`` (FSDP=4) and ``VitScaleStrategy(tensor_parallel=2)`` (TP=2 x FSDP=2), interleaved round
by round so that the machine's load falls on all three alike; the median step after two warm-up steps,
parameter + optimizer bytes per rank, and the bytes rank 0 sends per timed step on each mesh dimension (data
parallel, tensor parallel), recorded from the collectives those steps really issue by
``tests/helpers/recording.py``'s ``TrafficRecorder`` (the one ``benchmarks/hybrid_traffic.py`` and the planner
tests use: each call a ring over its process group). DDP's gradient buckets are all-reduced by its C++ reducer,
which no Python wrapper sees, so the DDP runs register ``allreduce_hook`` (torch's documented equivalent of the
built-in all-reduce: divide by the world, all-reduce each bucket) as the comm hook, which calls
``torch.distributed.all_reduce``. Beside the two VitScale rows, the strategy's own prediction (the setup summary's
traffic line: ``plan.layout``). Run under torch's launcher:

    torchrun --nproc-per-node=4 benchmarks/tensor_parallel.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples.models.vit import VisionTransformer  # noqa: E402
from lightning_vitscale import VitScaleStrategy, measure_state_bytes  # noqa: E402
from tests.helpers.recording import TrafficRecorder  # noqa: E402

STRATEGIES = ("ddp", "fsdp4", "tp2_fsdp2")
LABELS = {"ddp": "DDP", "fsdp4": "`VitScaleStrategy()` (FSDP=4)",
          "tp2_fsdp2": "`VitScaleStrategy(tensor_parallel=2)` (TP=2 x FSDP=2)"}
TENSOR_PARALLEL = {"ddp": 1, "fsdp4": 1, "tp2_fsdp2": 2}
DIMENSIONS = ("data_parallel", "tensor_parallel")
GLOBAL_BATCH = 16
WORLD = 4
WARM_UP = 2


@dataclass
class Result:
    """One run on this rank: seconds per timed step, state bytes, bytes sent per mesh dimension per timed step, and
    the strategy's predicted bytes per dimension (``None``: DDP, or a dimension it does not predict)."""

    seconds: list[float]
    state: int
    sent: list[dict[str, float]]
    planned: dict[str, float | None] = field(default_factory=dict)


class Probe(L.Callback):
    """Times each step and records the bytes its collectives send (forward, backward and optimizer step alike)."""

    def __init__(self, tensor_parallel: int) -> None:
        self.tensor_parallel = tensor_parallel
        self.times: list[float] = []
        self.sent: list[dict[str, float]] = []

    def on_train_start(self, trainer: L.Trainer, *_: object) -> None:
        if isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(None, allreduce_hook)

    def on_train_batch_start(self, *_: object) -> None:
        self._recording = TrafficRecorder(WORLD).recording()
        self._recorder = self._recording.__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_: object) -> None:
        self.times.append(time.perf_counter() - self._start)
        self._recording.__exit__(None, None, None)
        self.sent.append(self._recorder.by_dimension(WORLD, self.tensor_parallel))


class Model(L.LightningModule):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.vit = VisionTransformer(32, 4, 3, 10, dim, 4, 8, mlp_ratio=4.0)  # 64 tokens, 4 blocks, 8 heads

    def training_step(self, batch, _):
        return F.cross_entropy(self.vit(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def run(name: str, dim: int, steps: int) -> Result:
    """This rank's timed steps (after the warm-up), parameter + optimizer bytes, and bytes sent per dimension."""
    strategy = {"ddp": "ddp", "fsdp4": VitScaleStrategy(activation_checkpointing=False),
                "tp2_fsdp2": VitScaleStrategy(tensor_parallel=2, activation_checkpointing=False)}[name]
    per_rank = GLOBAL_BATCH // (2 if name == "tp2_fsdp2" else 4)
    n = GLOBAL_BATCH * steps
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    L.seed_everything(0, verbose=False)
    model, probe = Model(dim), Probe(TENSOR_PARALLEL[name])
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, callbacks=[probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=per_rank))
    state = measure_state_bytes(model, trainer.optimizers)
    result = Result(probe.times[WARM_UP:], state.params_local + state.optimizer_local, probe.sent[WARM_UP:])
    if isinstance(strategy, VitScaleStrategy):
        layout = strategy.plan.layout
        result.planned = {"data_parallel": layout.traffic.intra_node + layout.traffic.inter_node}
        if TENSOR_PARALLEL[name] > 1:
            result.planned["tensor_parallel"] = layout.tensor_sent
    return result


def sent_cell(name: str, result: Result, dimension: str) -> str:
    """Bytes per timed step on one dimension (the median; the range where steps differ), and the plan's; ``-``
    where the strategy's mesh has no such dimension (no tensor parallelism)."""
    if dimension == "tensor_parallel" and TENSOR_PARALLEL[name] == 1:
        return "-"
    values = sorted(step.get(dimension, 0.0) for step in result.sent)
    cell = f"{statistics.median(values):,.0f} B"
    if values[0] != values[-1]:
        cell += f" ({values[0]:,.0f}-{values[-1]:,.0f})"
    if dimension in result.planned:
        planned = result.planned[dimension]
        cell += " (plan: not predicted)" if planned is None else f" (plan {planned:,.0f} B)"
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.steps <= WARM_UP:
        parser.error(f"--steps {args.steps}: need more than the {WARM_UP} warm-up steps to time any")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results: dict[str, list[Result]] = {name: [] for name in STRATEGIES}
    for _ in range(args.rounds):
        for name in STRATEGIES:
            results[name].append(run(name, args.dim, args.steps))
    if dist.get_rank() != 0:
        return
    step = {name: statistics.median(statistics.median(r.seconds) for r in runs) for name, runs in results.items()}
    state = {name: runs[-1].state for name, runs in results.items()}
    print(f"dim {args.dim}, 4 blocks, 64 tokens, global batch {GLOBAL_BATCH}, {args.rounds} interleaved rounds,"
          f" {args.steps - WARM_UP} timed steps each; bytes: sent by rank 0 per step (ring per group), last round")
    print("| strategy | median step (s) | x DDP | param + optimizer bytes per rank | x DDP"
          " | data-parallel bytes/step | tensor-parallel bytes/step |")
    print("|---|---|---|---|---|---|---|")
    for name in STRATEGIES:
        last = results[name][-1]
        other = {k: v for step_sent in last.sent for k, v in step_sent.items() if k not in DIMENSIONS}
        cells = " | ".join(sent_cell(name, last, d) for d in DIMENSIONS)
        print(f"| {LABELS[name]} | {step[name]:.3f} | {step[name] / step['ddp']:.2f} | {state[name] / 2**20:.1f} MiB"
              f" | {state[name] / state['ddp']:.2f} | {cells} |" + (f" outside the mesh: {other}" if other else ""))


if __name__ == "__main__":
    main()
