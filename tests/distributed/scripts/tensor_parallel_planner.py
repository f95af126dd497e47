"""Rank script: the memory planner's prediction for a tensor-parallel run against a measured ``Trainer.fit`` step,
and its traffic per mesh dimension against what gloo moves. ``tensor_parallel_planner.py OUT ac:batch,...``.

4 CPU ranks, ``VitScaleStrategy(tensor_parallel=2)`` (TP=2 x FSDP=2), timm's ``vit_tiny_patch16_224`` built locally
at random init (no download) at 64 px (16 patches + the class token) with 4 heads instead of 3 (3 do not split
over 2 ranks), fp32, AdamW, one block per unit resharded after forward (the step model's cells, as
``planner_fit.py``), ``ac`` ``off`` or ``full``, ``batch`` samples per data-parallel rank.

Measured as ``planner_fit.py`` measures (its ``MeasuredStrategy``: the smaller RSS growth of two optimizer steps,
every allocation of 64 KiB or more its own mmap, the gradient shards alive at the start added back); the bytes sent
over each mesh dimension during those steps, every ``torch.distributed`` collective and DTensor's functional
all-reduce counted as a ring over its group (``tests/helpers/recording.py``). Predicted: the planner's peak for the
same step minus the resident state, from the batch the strategy plans with (``example_input_array``), with the
blocks split as the strategy splits them (``tensor_parallel=2``) and, for contrast, without the split
(``unsplit``: what a TP run was planned as before).
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale.memory.planning_batch import EXAMPLE_INPUT, PlanningBatch, measure_batch
from lightning_vitscale.memory.step_cost import traffic_per_dimension
from lightning_vitscale.memory.step_inputs import StepSettings, TrainingLoop
from lightning_vitscale.memory.step_model import predict_step
from tests.distributed.scripts.planner_fit import MeasuredStrategy
from tests.helpers.peak import mmap_large_allocations
from tests.helpers.recording import TrafficRecorder, per_dimension
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
TP, IMAGE, STEPS = 2, 64, 3  # one step for the optimizer state, two measured (planner_fit's MEASURED_REPEATS)
UNSPLIT = ("off",)  # the cells whose memory the test checks (MEMORY_CELLS): only they need the unsplit prediction


def build() -> torch.nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, num_classes=10, num_heads=4)


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class CountedStrategy(MeasuredStrategy):
    """``MeasuredStrategy`` that also counts the bytes sent per process group over the measured steps."""

    def __init__(self, **kwargs) -> None:
        super().__init__(1, **kwargs)
        self.recorder = TrafficRecorder(WORLD)
        self._recording = None
        self.sent: list[dict] = []

    def training_step(self, *args, **kwargs):
        if self.steps >= 1:
            self._recording = self.recorder.recording()
            self._recording.__enter__()
            self.recorder.by_group.clear()
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, *args, **kwargs):
        output = super().optimizer_step(*args, **kwargs)
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
            self.sent.append(dict(self.recorder.by_group))
        return output


def predicted(ac: str, batch: int, tensor_parallel: int) -> tuple[int, int, dict[str, float], str]:
    """(peak, step increment, traffic per dimension, phase) the planner predicts for the cell's step."""
    loop = TrainingLoop(released_after_step=True)
    with torch.device("meta"):
        planned = Classifier()
        x = torch.empty(batch, 3, IMAGE, IMAGE)
    inputs, _ = measure_batch(planned, PlanningBatch(x, EXAMPLE_INPUT),
                              world_size=WORLD // TP, precision="32-true", device="cpu", loop=loop,
                              tensor_parallel=tensor_parallel)
    every = frozenset(range(len(inputs.profile.blocks)))
    settings = StepSettings(every if ac == "full" else frozenset())
    step = predict_step(inputs, settings)
    resident = step.params + step.optimizer + step.norms + step.batch
    traffic = traffic_per_dimension(inputs, settings, outer_reshards=True)  # reshard_after_forward=True: every unit
    return step.peak, step.peak - resident, traffic, step.phase


def cell(ac: str, batch: int) -> dict:
    peak, increment, traffic, phase = predicted(ac, batch, TP)
    # The whole-block plan, for contrast, where the test compares memory (ac off only: see UNSPLIT).
    unsplit = predicted(ac, batch, 1)[1] if ac in UNSPLIT else None
    strategy = CountedStrategy(tensor_parallel=TP, activation_checkpointing=ac == "full", blocks_per_unit=1,
                               reshard_after_forward=True)
    L.seed_everything(0, verbose=False)
    model = Classifier()
    model.example_input_array = torch.empty(batch, 3, IMAGE, IMAGE)  # the strategy plans at setup from it
    n = batch * STEPS * (WORLD // TP)
    data = TensorDataset(torch.randn(n, 3, IMAGE, IMAGE), torch.randint(0, 10, (n,)))
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=STEPS, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision="32-true")
    trainer.fit(model, DataLoader(data, batch_size=batch))
    measured_traffic = [per_dimension(step, WORLD, TP) for step in strategy.sent]
    return dict(measured=min(strategy.growths), growths=strategy.growths, predicted=increment, unsplit=unsplit,
                phase=phase, planned_peak=peak, summary_peak=strategy.plan.predicted_peak,
                summary=strategy.plan.summary(), traffic=traffic, measured_traffic=measured_traffic,
                rank=dist.get_rank())


if __name__ == "__main__":
    torch.set_num_threads(1)
    mmap_large_allocations()
    run_scenarios({spec: (lambda s=spec: cell(s.split(":")[0], int(s.split(":")[1])))
                   for spec in sys.argv[2].split(",")})
