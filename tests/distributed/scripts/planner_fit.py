"""Rank script: the memory planner's predicted step against a measured ``Trainer.fit`` step (Lightning's own loop).

``planner_fit.py OUT_DIR model:ac:batch[:loop],...`` e.g. ``deit_tiny:off:8`` or ``vit_b_16:full:16:manual``.
``ac`` is ``off``, ``full``, ``selective`` (one block per unit, resharded: the step model's cells), ``auto-P``:
``activation_checkpointing="auto"`` under a budget P% of the way from every block checkpointed (and resharded)
to none (every block kept gathered), decided at setup from one batch of the train dataloader (the planner also
chooses ``blocks_per_unit``); ``autok-P`` the same from ``example_input_array``; ``default-P`` the same under
``VitScaleStrategy(memory_budget=...)``'s default (``priority="speed"``); ``default``: ``VitScaleStrategy()`` as it
comes (the host's memory to spare: the planner's plan from the train dataloader's batch); ``unused-P``: ``default-P``
with ``find_unused_parameters=True`` (every block in the outer unit, gathered).
``auto``, ``default`` and ``unused`` cells also train the same model under DDP for its losses. ``loop`` is
``auto`` (automatic optimization, the default: the strategy frees the gradients after the step), ``observed``
(the same with a callback reading gradients after the step: they are kept through the next forward), ``manual``
(zero_grad, forward, manual_backward, step), ``acc2`` (automatic, ``accumulate_grad_batches=2``) or ``noforward``
(automatic, a LightningModule without ``forward`` whose ``training_step`` calls the network: measured through
``training_step``). Published architectures
at random init (no download): torchvision ``vit_b_16`` and timm ``deit_tiny_patch16_224`` / ``vit_small_patch16_224``
at a small image size, fp32, AdamW, ``VitScaleStrategy()``; ``shared_tiny``: DeiT-Tiny's first block shared by its 12
layers (named with ``blocks=``); ``twocrop_tiny``: DeiT-Tiny run on the images and on crops of them (DINO's
multi-crop; its blocks' gradients held between the passes: benchmarks/RESULTS.md).

Measured: peak RSS growth over the second and third optimizer steps, the smaller kept (``MEASURED_REPEATS``;
optimizer state exists, the previous step's gradients too unless released), each from its first
``training_step`` to the end of its ``optimizer_step``, with every allocation of 64 KiB or more its own mmap (set
by the script first, ``tests.helpers.peak.mmap_large_allocations``: its ranks fork from the test zygote) so freed
memory leaves RSS; the gradient shards alive at the start are added back (they are part of the step, not of the
resident state). Predicted: the planner's peak for the same step
minus the resident state (sharded parameters, optimizer state, replicated norms, the batch). The step's measured
peak (``measured_peak``): the resident state as it is at the window's start (local parameter and optimizer bytes,
the batch) plus the measured increment.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.memory import measure_state_bytes
from lightning_vitscale.memory.planner import choose, step_inputs
from lightning_vitscale.memory.planning_batch import TRAIN_BATCH, PlanningBatch, measure_batch
from lightning_vitscale.memory.step_cost import rates_for
from lightning_vitscale.memory.step_inputs import StepInputs, StepSettings, TrainingLoop
from lightning_vitscale.memory.step_model import predict_step
from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode
from tests.helpers.peak import RssWindow, mmap_large_allocations
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
MEASURED_STEP = 1  # optimizer steps before the first measured one (its optimizer state and gradients exist)
# Identical steps measured, the smallest growth kept. With asynchronous collectives on CPU (sharding/cpu_overlap.py)
# gloo's worker thread copies each all-gather and reduce-scatter through a flat buffer of the unit's unsharded size,
# and RSS catches it wherever it happens to overlap the step's peak: +2 to +2.6 MiB (one unit of DeiT-Tiny) in about
# one rank-run in ten, at random (none with the collectives synchronous: 31.0-31.15 MiB in six rank-runs). The
# planner predicts the step, not that coincidence; the smaller of two steps is the step's own high-water mark.
MEASURED_REPEATS = 2
STEPS = MEASURED_STEP + MEASURED_REPEATS


def build(name: str) -> tuple[nn.Module, int]:
    """A published architecture at random init, and its image size."""
    if name == "vit_b_16":
        from torchvision.models import vit_b_16

        return vit_b_16(image_size=96, num_classes=10), 96
    import timm

    if name == "twocrop_tiny":  # DINO's multi-crop: the backbone on the 64 px images, then on 32 px crops of them
        return TwoCrops(timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10,
                                          dynamic_img_size=True)), 64
    if name == "shared_tiny":  # ALBERT's layout: DeiT-Tiny's first block, its weights shared by all 12 layers
        net = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10, depth=1)
        net.blocks = nn.Sequential(*[net.blocks[0]] * 12)  # one module, called 12 times a forward
        return net, 64
    timm_name, image = {"deit_tiny": ("deit_tiny_patch16_224", 64), "vit_small": ("vit_small_patch16_224", 96)}[name]
    return timm.create_model(timm_name, pretrained=False, img_size=image, num_classes=10), image


def blocks_of(name: str) -> set[type[nn.Module]] | None:
    """The block class to name where discovery finds none (a block every layer shares), else ``None``."""
    from timm.models.vision_transformer import Block

    return {Block} if name == "shared_tiny" else None


class TwoCrops(nn.Module):
    """Every block runs twice a step, on inputs of two sizes (16 and 4 tokens a crop, class token aside)."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit

    @property
    def blocks(self) -> nn.Module:
        return self.vit.blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit(x) + self.vit(x[..., 16:48, 16:48])


class Classifier(L.LightningModule):
    def __init__(self, name: str, automatic: bool = True) -> None:
        super().__init__()
        self.net, self.image = build(name)
        self.automatic_optimization = automatic
        self.losses: list[float] = []
        self.gathered: list[bool] = []  # per block, after the first forward: still gathered for backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:
            loss = F.cross_entropy(self(x), y)
            self.losses.append(loss.item())
            if batch_idx == 0 and hasattr(self.net, "blocks"):  # a resharded block holds DTensor shards now
                self.gathered = [not isinstance(b.attn.qkv.weight, DTensor) for b in self.net.blocks]
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class NoForward(Classifier):
    """The same network called from ``training_step``, with no ``forward``: what the planner measures is what
    ``training_step`` runs."""

    forward = L.LightningModule.forward

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.detach())
        if batch_idx == 0:
            self.gathered = [not isinstance(b.attn.qkv.weight, DTensor) for b in self.net.blocks]
        return loss


def module_for(name: str, kind: str) -> Classifier:
    return NoForward(name) if kind == "noforward" else Classifier(name, automatic=kind != "manual")


class MeasuredStrategy(VitScaleStrategy):
    """``VitScaleStrategy`` measuring the RSS growth of optimizer steps ``MEASURED_STEP`` on (all their
    micro-batches), each from its first ``training_step`` to the end of its ``optimizer_step``, gradients alive at
    its start added back; the test keeps the smallest (see ``MEASURED_REPEATS``). A strategy, not a callback: a
    user callback's batch hooks could observe gradients and would keep them."""

    def __init__(self, accumulate: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.window, self.accumulate, self.steps = RssWindow(), accumulate, 0
        self.grads_at_start, self.growths, self.resident = 0, [], 0
        self.released = False

    def training_step(self, *args, **kwargs):
        batch_idx = args[1] if len(args) > 1 else -1
        if batch_idx >= MEASURED_STEP * self.accumulate and batch_idx % self.accumulate == 0:
            state = measure_state_bytes(self.lightning_module, self.optimizers)
            self.grads_at_start, self.resident = state.grads_local, state.params_local + state.optimizer_local
            self.window.start()
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, *args, **kwargs):
        output = super().optimizer_step(*args, **kwargs)
        self.steps += 1
        if self.steps > MEASURED_STEP:
            self.growths.append(self.window.peak_growth() + self.grads_at_start)
            self.released = all(p.grad is None for p in self.lightning_module.parameters())
        return output


class ReadsGradients(L.Callback):
    """A user callback that looks at gradients after the step: the strategy must keep them for it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen = any(p.grad is not None for p in pl_module.parameters())


def loop_of(kind: str) -> tuple[TrainingLoop, int]:
    """``auto`` / ``acc2``: automatic optimization, gradients released after the step (nothing observes them);
    ``observed``: the same with a callback reading them; ``manual``: zero_grad first."""
    accumulate = 2 if kind == "acc2" else 1
    released = kind in ("auto", "acc2", "noforward")
    return TrainingLoop(kind != "manual", accumulate, released_after_step=released), accumulate


def planned_for(inputs: StepInputs, ac: str, batch: int) -> tuple[StepSettings, dict]:
    """The settings a cell's step runs, and what "auto" planned (its budget and per-block plan); the default's
    units are read from what the strategy built (see :func:`cell`)."""
    every = frozenset(range(len(inputs.profile.blocks)))
    if ac == "default":
        return StepSettings(every), {"budget": None}
    if not ac.startswith(("auto", "default-", "unused-")):
        return StepSettings(every if ac != "off" else frozenset(),
                            selective=every if ac == "selective" else frozenset()), {}
    least = predict_step(inputs, StepSettings(every)).peak
    most = predict_step(inputs, StepSettings(reshard_after_forward=False)).peak
    budget = least + (most - least) * int(ac.split("-")[1]) // 100
    if ac.startswith("unused-"):  # the budget only: the plan is read from what the strategy built (see cell)
        return StepSettings(every), {"budget": budget}
    plan = choose(inputs, budget, budget, "32-true", batch, offload=False, rates=rates_for("cpu"), per_unit=None)
    modes = list(plan.blocks.modes)
    kept = [plan.chosen.settings.keeps(i) for i in range(len(every))]
    return plan.chosen.settings, dict(budget=budget, modes=modes, resharded=plan.blocks.resharded, kept=kept,
                                      per_unit=plan.blocks.per_unit)


def fit(name: str, ac: str, batch: int, kind: str, strategy) -> Classifier:
    """``Trainer.fit`` of ``STEPS`` optimizer steps from seed 0 under ``strategy``."""
    accumulate = loop_of(kind)[1]
    L.seed_everything(0, verbose=False)
    model = module_for(name, kind)
    steps = STEPS * accumulate * WORLD  # one epoch: every rank takes its own batches
    image = model.image
    if ac.startswith("autok"):
        model.example_input_array = torch.empty(batch, 3, image, image)
    data = TensorDataset(torch.randn(batch * steps, 3, image, image), torch.randint(0, 10, (batch * steps,)))
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=STEPS, strategy=strategy,
                        callbacks=[ReadsGradients()] if kind == "observed" else [],
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, precision="32-true")
    trainer.fit(model, DataLoader(data, batch_size=batch))
    return model


# The planner's fake-tensor measurement of a model, batch and loop: the same for every cell that shares them (the
# cells off / full / selective at one batch, say), measured once (~0.9 s each for DeiT-Tiny).
MEASURED: dict[tuple[str, int, str, bool], StepInputs] = {}


def cell(name: str, ac: str, batch: int, kind: str = "auto") -> dict:
    loop, accumulate = loop_of(kind)
    with torch.device("meta"):
        planned = module_for(name, kind)
        image = planned.image
        x, y = torch.empty(batch, 3, image, image), torch.empty(batch, dtype=torch.long)
    # measured as the strategy measures it ("auto", the default: training_step on the batch) or from forward
    through_training_step = ac.startswith(("default", "auto-", "unused-"))
    key = (name, batch, kind, through_training_step)  # what the measurement depends on (ac does not change it)
    if key not in MEASURED:
        if through_training_step:
            MEASURED[key] = measure_batch(
                planned, PlanningBatch((x, y), TRAIN_BATCH, through_training_step=True), world_size=WORLD,
                precision="32-true", device="cpu", loop=loop,
            )[0]
        else:
            MEASURED[key] = step_inputs(planned, x, world_size=WORLD, precision="32-true", device="cpu", loop=loop,
                                        blocks=blocks_of(name))
    inputs = MEASURED[key]
    depth = len(inputs.profile.blocks)
    settings, auto = planned_for(inputs, ac, batch)
    predicted = predict_step(inputs, settings)
    resident = predicted.params + predicted.optimizer + predicted.norms + predicted.batch
    del planned

    if ac in ("off", "full", "selective"):  # the step model's cells: one block per unit, resharded, as before
        options = dict(activation_checkpointing={"off": False, "full": True, "selective": "selective"}[ac],
                       blocks_per_unit=1, reshard_after_forward=True)
    elif ac.startswith("unused-"):  # every block in the outer unit, kept gathered: the planner must plan that
        options = dict(find_unused_parameters=True, memory_budget=auto["budget"])
    else:  # "default": VitScaleStrategy() as it comes; "default-P" with a memory_budget
        options = dict(memory_budget=auto["budget"]) if ac.startswith("default") else dict(
            activation_checkpointing="auto", memory_budget=auto["budget"])
    strategy = MeasuredStrategy(accumulate, blocks=blocks_of(name), **options)
    model = fit(name, ac, batch, kind, strategy)
    if ac == "default" or ac.startswith("unused-"):  # the planner's plan as built: predicted for it
        kept = frozenset(i for i, gathered in enumerate(model.gathered) if gathered)
        modes = [checkpoint_mode(b) for b in model.net.blocks]
        settings = StepSettings(frozenset(i for i, mode in enumerate(modes) if mode),
                                selective=frozenset(i for i, mode in enumerate(modes) if mode == "selective"),
                                kept_gathered=kept, blocks_per_unit=strategy.plan.blocks_per_unit)
        predicted = predict_step(inputs, settings)
        resident = predicted.params + predicted.optimizer + predicted.norms + predicted.batch
        auto.update(per_unit=strategy.plan.blocks_per_unit, kept=sorted(kept))
    if auto:  # what the strategy applied, and DDP's losses for the same seed and data
        auto.update(applied=[checkpoint_mode(b) for b in model.net.blocks], gathered=model.gathered,
                    summary=strategy.plan.summary(), predicted_peak=strategy.plan.predicted_peak,
                    planned_peak=predicted.peak, losses=[float(v) for v in model.losses], units=strategy.plan.units,
                    applied_per_unit=strategy.plan.blocks_per_unit,
                    ddp_losses=ddp_losses(name, ac, batch, kind))
    assert len(strategy.growths) == MEASURED_REPEATS, strategy.growths
    batch_bytes = batch * 3 * image * image * 4 + batch * 8  # the step's (x, y): fp32 images, int64 labels
    return dict(measured=min(strategy.growths), growths=strategy.growths, predicted=predicted.peak - resident,
                measured_peak=strategy.resident + batch_bytes + min(strategy.growths),
                phase=predicted.phase,
                grads_at_start=strategy.grads_at_start, depth=depth, released=strategy.released, auto=auto,
                breakdown={k: getattr(predicted, k) for k in ("params", "grads", "optimizer", "norms", "gathered",
                                                               "activations", "transient", "batch")})


DDP_LOSSES: dict[tuple[str, int, str], list[float]] = {}


def ddp_losses(name: str, ac: str, batch: int, kind: str) -> list[float]:
    """DDP's losses for the cell's model, seed and data (one fit per model, batch and loop: ``ac`` changes none)."""
    key = (name, batch, kind)
    if key not in DDP_LOSSES:
        DDP_LOSSES[key] = [float(v) for v in fit(name, ac, batch, kind, "ddp").losses]
    return DDP_LOSSES[key]


def parse(spec: str) -> dict:
    name, ac, batch, *kind = spec.split(":")
    return cell(name, ac, int(batch), *kind)


if __name__ == "__main__":
    import sys

    mmap_large_allocations()
    scenarios = {spec: (lambda s=spec: parse(s)) for spec in sys.argv[2].split(",")}
    if "auto" in scenarios:  # memory_planner.py's "auto" scenario (Lightning's own loop too): in the same launch
        from tests.distributed.scripts.memory_planner import auto_first_step

        scenarios["auto"] = auto_first_step
    run_scenarios(scenarios)
