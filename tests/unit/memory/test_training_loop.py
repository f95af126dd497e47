"""The planner follows Lightning's loop order (when gradients are alive) and ``"auto"`` plans for what is on.

The measured side of the loop order is ``tests/distributed/test_memory_planner.py`` (``Trainer.fit`` steps)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing
from lightning_vitscale.memory.measurement import Measurement, training_loop
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_inputs import StepSettings, TrainingLoop
from lightning_vitscale.memory.step_model import predict_step, step_phases

LONG = dict(image=64, patch=4, dim=96, depth=4)
WIDE = dict(image=32, patch=4, dim=256, depth=6)  # parameter-heavy: the gradients decide where the peak is


def meta_model(shape: dict = LONG) -> TinyViT:
    with torch.device("meta"):
        return TinyViT(**shape)


def planned(loop: TrainingLoop, settings: StepSettings | None = None):
    x = torch.empty(8, 3, 32, 32, device="meta")
    inputs = step_inputs(meta_model(WIDE), x, world_size=2, precision="32-true", device="cpu", loop=loop)
    return inputs, predict_step(inputs, settings or StepSettings())


def test_automatic_optimization_keeps_the_previous_gradients_through_the_forward():
    """Lightning runs training_step before zero_grad: the gradient shards of the last step live through the
    forward, so the forward's peak carries them; zero_grad first (manual optimization) frees them before."""
    inputs, automatic = planned(TrainingLoop())
    _, manual = planned(TrainingLoop(automatic=False))  # zero_grad first, as a hand-written loop
    forward = [b for b in step_phases(inputs, StepSettings()) if b.phase == "end of forward"][0]
    assert forward.grads == forward.params > 0  # the forward carries the last step's gradient shards
    assert automatic.phase != manual.phase
    assert automatic.grads == automatic.params > 0 and automatic.peak > manual.peak
    released = predict_step(replace(inputs, loop=TrainingLoop(released_after_step=True)), StepSettings())
    assert released == manual


def test_accumulation_and_zeroed_gradients_keep_every_shard_through_backward():
    every = StepSettings(frozenset(range(6)))
    _, once = planned(TrainingLoop(), every)
    for loop in (TrainingLoop(accumulate=2), TrainingLoop(set_to_none=False), TrainingLoop(False, 4)):
        _, kept = planned(loop, every)
        assert kept.grads == kept.params and kept.peak > once.peak, loop
    assert training_loop(torch.nn.Linear(1, 1), None) == TrainingLoop()


def test_the_loop_is_the_trainers_it_is_given():
    """The Trainer is passed, not read off the module: its accumulation, and whether a callback's hook between the
    optimizer step and zero_grad keeps the gradients. Mutation seen failing: ``training_loop`` ignoring ``trainer``
    (the module attached to none)."""
    import lightning as L

    class ReadsGradients(L.Callback):
        def on_train_batch_end(self, *args) -> None: ...

    model = TinyViT(**LONG)
    plain = L.Trainer(accelerator="cpu", accumulate_grad_batches=3, logger=False, enable_checkpointing=False)
    assert training_loop(model, plain) == TrainingLoop(accumulate=3, released_after_step=True)
    watched = L.Trainer(accelerator="cpu", callbacks=[ReadsGradients()], logger=False, enable_checkpointing=False)
    assert training_loop(model, watched) == TrainingLoop()


def test_auto_warns_when_no_choice_meets_the_budget_and_never_assumes_offload():
    """A budget nothing meets: every block checkpointed, a warning naming the fixes, and a predicted peak for
    what is really on (offload off), not the offloaded one the stand-alone planner would recommend."""
    model = meta_model()
    x = torch.empty(8, 3, 64, 64, device="meta")
    inputs = step_inputs(model, x, world_size=2, precision="32-true")
    every = predict_step(inputs, StepSettings(frozenset(range(4))))
    budget = predict_step(inputs, StepSettings(frozenset(range(4)), offload=True)).peak  # met by offload alone
    assert budget < every.peak
    choice = AutoCheckpointing(budget, Measurement(2, "32-true"), blocks_per_unit=1).choose(model, x)
    assert choice.names == [f"blocks.{i}" for i in range(4)] and not choice.plan.chosen.settings.offload
    assert choice.plan.chosen.breakdown.peak == every.peak and not choice.plan.fits
    assert choice.warning is not None and "offload='cpu' (predicted" in choice.warning
    assert "a per-rank batch of" in choice.warning and "memory_budget" in choice.warning
    hopeless = AutoCheckpointing(1, Measurement(2, "32-true"), blocks_per_unit=1).choose(model, x)
    assert hopeless.warning is not None and "offload" not in hopeless.warning  # would not fit either
    offloaded = AutoCheckpointing(budget, Measurement(2, "32-true"), offload=True, blocks_per_unit=1).choose(model, x)
    assert offloaded.plan.fits and offloaded.plan.chosen.settings.offload and offloaded.warning is None

    real = TinyViT(**LONG)
    real.example_input_array = torch.randn(8, 3, 64, 64)
    auto = AutoCheckpointing(budget, Measurement(2, "32-true"))
    with pytest.warns(UserWarning, match=r"no choice fits the memory budget .* offload='cpu' \(predicted"):
        names = auto.at_setup(real, torch.device("cpu"), lambda plan: plan).names
    assert names == [f"blocks.{i}" for i in range(4)]
    assert auto.choice is not None and auto.choice.plan.chosen.breakdown.peak == every.peak
