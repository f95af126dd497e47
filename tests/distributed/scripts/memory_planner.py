"""Rank script: one training step's real peak memory (allocator events) next to the planner's prediction.

``memory_planner.py OUT_DIR shape:ac:precision,...`` e.g. ``wide:on:32-true``. Each scenario builds the model,
shards it with the strategy's pipeline, takes two warm-up steps (optimizer state exists, as in any later step),
then measures a step in the order of Lightning's manual optimization as documented: zero_grad(set_to_none) ->
forward -> backward -> step, each of the three phases from its own baseline (see ``tests/helpers/peak.py``); the
planner is told that order (``TrainingLoop(automatic=False)``). Lightning's automatic order is checked through
``Trainer.fit`` in ``planner_fit.py``.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lightning_vitscale._compat import fsdp_param_groups
from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.kernels.optimizers import prefer_foreach
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_inputs import StepSettings, TrainingLoop
from lightning_vitscale.memory.step_model import predict_step
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from tests.helpers.models import Streamed
from tests.helpers.peak import phased_step_peak
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))

# TinyViT arguments and per-rank batch: "wide" is parameter-heavy, "long" is activation-heavy (256 tokens).
SHAPES = {
    "wide": (dict(image=32, patch=4, dim=256, depth=6), 8),
    "long": (dict(image=64, patch=4, dim=96, depth=4), 8),
}


def scenario(shape: str, ac: str, precision: str) -> dict:
    kwargs, batch = SHAPES[shape]
    world = dist.get_world_size()
    policy = resolve_flag(precision)
    with torch.device("meta"):
        planned = TinyViT(**kwargs)
    inputs = step_inputs(planned, torch.empty(batch, 3, kwargs["image"], kwargs["image"], device="meta"),
                         world_size=world, precision=precision, device="cpu", loop=TrainingLoop(automatic=False))
    checkpointed = frozenset(range(kwargs["depth"])) if ac == "on" else frozenset()
    predicted = predict_step(inputs, StepSettings(checkpointed))
    del planned, inputs

    torch.manual_seed(0)
    model = TinyViT(**kwargs)
    if policy.master != torch.float32:
        model = model.to(policy.master)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    root = OuterUnit(model)
    config = ParallelConfig(checkpointing=CheckpointingPolicy(blocks=ac == "on"))
    done = parallelize(root, model, mesh, config, policy, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prefer_foreach([optimizer])
    x = torch.randn(batch, 3, kwargs["image"], kwargs["image"])
    y = torch.randint(0, 10, (batch,))

    held: dict[str, torch.Tensor] = {}

    def forward() -> None:
        optimizer.zero_grad(set_to_none=True)
        held["loss"] = F.cross_entropy(root(x).float(), y)

    def backward() -> None:
        held.pop("loss").backward()
        if done.norms is not None:
            done.norms.reduce_grads()

    before, peak = phased_step_peak([forward, backward, optimizer.step])
    result = dict(measured=peak, before=before, predicted=predicted.peak, phase=predicted.phase,
                  breakdown={k: getattr(predicted, k) for k in ("params", "grads", "optimizer", "norms",
                                                                 "gathered", "activations", "transient", "batch")})
    gc.collect()
    return result


class BranchingViT(TinyViT):
    """A forward that branches on a value, as torchvision's detection models do on their boxes: fake tensors cannot
    follow it, fake tensors carrying real values can (never taken here: DDP's numbers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * 0.5 if out.abs().max() > 1e6 else out




def auto_first_step() -> dict:
    """``VitScaleStrategy()``'s default checkpointing (``"auto"``'s planner) through Lightning, decided at the first
    step (no example_input_array, and training data that is no ``DataLoader``, so no batch at setup: one block per
    unit, made at setup), under a budget halfway between every block and no block checkpointed."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_vitscale import VitScaleStrategy
    from lightning_vitscale.cli.demo import generated_images
    from lightning_vitscale.memory import twin
    from lightning_vitscale.memory.measurement import training_loop
    from lightning_vitscale.memory.plan_search import SearchSpace, search
    from lightning_vitscale.memory.planner import choose
    from lightning_vitscale.memory.step_cost import rates_for
    from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode

    kwargs, batch = SHAPES["long"]
    with torch.device("meta"):
        planned = TinyViT(**kwargs)
    inputs = step_inputs(planned, torch.empty(batch, 3, 64, 64, device="meta"), world_size=WORLD,
                         precision="32-true", device="cpu")
    every = predict_step(inputs, StepSettings(frozenset(range(kwargs["depth"])))).peak
    budget = (every + predict_step(inputs, StepSettings()).peak) // 2
    L.seed_everything(0, verbose=False)
    model = TinyViT(**kwargs)
    strategy = VitScaleStrategy(memory_budget=budget)  # the default (priority="speed"): "auto"'s planner
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = DataLoader(generated_images(n=64, image=64), batch_size=batch)
    trainer.fit(model, Streamed(data))
    # The user's checkpointing with example_input_array set: the summary carries the predicted peak too.
    other = TinyViT(**kwargs)
    other.example_input_array = torch.randn(batch, 3, 64, 64)
    default = VitScaleStrategy(activation_checkpointing=True)
    L.Trainer(accelerator="cpu", devices=WORLD, strategy=default, max_steps=1, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(other, data)
    # The planner's own choice for this step (the Trainer's loop: gradients released after the step, on CPU).
    inputs = step_inputs(planned, torch.empty(batch, 3, 64, 64, device="meta"), world_size=WORLD,
                         precision="32-true", device="cpu", loop=training_loop(model, trainer))
    expected = choose(inputs, budget, budget, "32-true", batch, offload=False, rates=rates_for("cpu")).blocks
    # Its blocks per unit and units kept gathered: the one search's with every block's checkpointing pinned to
    # full, the host's memory to spare.
    units = search(SearchSpace(inputs, 2**40, rates_for("cpu"), per_unit=None, modes=("full",) * kwargs["depth"]))
    kept = units.settings().kept_gathered
    # The default with the host's memory on the same streamed data: blocks grouped into units at setup (from the
    # collectives' cost alone), the first step's plan made for those units; the same with every block checkpointed
    # (no first-step plan: the units are all setup chooses); DDP on the same batches.
    L.seed_everything(0, verbose=False)
    grouped_model, grouped = TinyViT(**kwargs), VitScaleStrategy()
    L.Trainer(accelerator="cpu", devices=WORLD, strategy=grouped, max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(grouped_model, Streamed(data))
    L.seed_everything(0, verbose=False)
    pinned_model, pinned = TinyViT(**kwargs), VitScaleStrategy(activation_checkpointing=True)
    L.Trainer(accelerator="cpu", devices=WORLD, strategy=pinned, max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(pinned_model, Streamed(data))
    # The same pinned checkpointing on a DataLoader (a batch at setup) whose step fake tensors cannot follow (the
    # forward branches on a value, as torchvision's detection models do) and, the size the planner copies to the
    # host pinned below the model's, real values cannot either: grouped as without a batch.
    limit, twin.REAL_VALUES_LIMIT = twin.REAL_VALUES_LIMIT, 0
    L.seed_everything(0, verbose=False)
    branching_model, branching = BranchingViT(**kwargs), VitScaleStrategy(activation_checkpointing=True)
    L.Trainer(accelerator="cpu", devices=WORLD, strategy=branching, max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False).fit(branching_model, data)  # every rank the same batches, as streamed
    L.seed_everything(0, verbose=False)
    fallback_model, fallback = BranchingViT(**kwargs), VitScaleStrategy()  # the default's recipe fallback
    L.Trainer(accelerator="cpu", devices=WORLD, strategy=fallback, max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False).fit(fallback_model, data)
    twin.REAL_VALUES_LIMIT = limit
    # The default on a forward that branches on a value: measured on real values (its first 2 and 3 samples,
    # extrapolated to the batch of 8) and planned as the same model without the branch.
    plans = {}
    for name, model_class in (("real", BranchingViT), ("plain", TinyViT)):
        L.seed_everything(0, verbose=False)
        plans[name] = (model_class(**kwargs), VitScaleStrategy())
        L.Trainer(accelerator="cpu", devices=WORLD, strategy=plans[name][1], max_steps=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  use_distributed_sampler=False).fit(plans[name][0], data)
    L.seed_everything(0, verbose=False)
    ddp_model = TinyViT(**kwargs)
    L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(ddp_model, Streamed(data))
    return dict(checkpointed=strategy.plan.checkpointed, summary=strategy.plan.summary(),
                grouped_summary=grouped.plan.summary(), grouped_per_unit=grouped.plan.blocks_per_unit,
                grouped_losses=grouped_model.losses, ddp_losses=ddp_model.losses,
                pinned_summary=pinned.plan.summary(), pinned_per_unit=pinned.plan.blocks_per_unit,
                pinned_losses=pinned_model.losses, branching_summary=branching.plan.summary(),
                branching_per_unit=branching.plan.blocks_per_unit, branching_losses=branching_model.losses,
                fallback_summary=fallback.plan.summary(), fallback_per_unit=fallback.plan.blocks_per_unit,
                fallback_checkpointed=len(fallback.plan.checkpointed), fallback_losses=fallback_model.losses,
                real_summary=plans["real"][1].plan.summary(), plain_summary=plans["plain"][1].plan.summary(),
                real_losses=plans["real"][0].losses,
                expected=[expected.modes.count("full"), expected.modes.count("selective"), expected.resharded],
                patched=[checkpoint_mode(b) for b in model.blocks], losses=model.losses,
                default_summary=default.plan.summary(), default_peak=default.plan.predicted_peak,
                default_per_unit=default.plan.blocks_per_unit, expected_per_unit=units.per_unit,
                default_kept=[i for i, block in enumerate(other.blocks) if not resharded(block)],
                expected_kept=sorted(kept),
                every=predict_step(inputs, units.settings()).peak)


def resharded(block) -> bool:
    """Whether FSDP2 frees ``block``'s unit's gathered parameters after forward (its post-forward mesh is set)."""
    return fsdp_param_groups(block)[0].post_forward_mesh_info is not None


if __name__ == "__main__":
    names = sys.argv[2].split(",")
    if "auto" in names:  # Lightning sets up its own process group
        run_scenarios({"auto": auto_first_step})
    else:
        dist.init_process_group("gloo")
        run_scenarios({name: (lambda n=name: scenario(*n.split(":"))) for name in names})
        dist.destroy_process_group()
