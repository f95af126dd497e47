"""``kernels="auto"`` with no batch at setup: the blocks are compiled, or not, at the first training step from its
plan (``ShardedModel.before_training_step``), not blindly at setup. On CPU ``"auto"`` never compiles, so the tests
give ``"auto"`` CUDA's preset and count ``torch.compile``'s calls (an identity: the numbers stay eager's) through
``Trainer.fit`` with streamed data, which gives setup no batch."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.kernels import KernelPolicy, settings
from lightning_vitscale.kernels.compile import is_compiled
from lightning_vitscale.sharding import deferred_compile, resolved
from lightning_vitscale.sharding.resolved import COMPILE_AT_FIRST_STEP
from tests.helpers.models import Classifier, loader, random_images
from tests.unit.sharding.test_compute_copies import fit_streamed


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """``"auto"`` resolved as on CUDA (compile, no batch yet); ``torch.compile`` recorded and left out."""
    calls: list[object] = []

    def recorded(fn, **_):
        calls.append(fn)
        return fn

    cuda_auto = KernelPolicy(compile_blocks=True, reason=settings.NO_BATCH)
    original = settings._preset

    def preset(mode, device):
        return cuda_auto if mode == "auto" else original(mode, device)

    monkeypatch.setattr(settings, "_preset", preset)
    monkeypatch.setattr(torch, "compile", recorded)
    return calls


def blocks_of(run: L.Trainer) -> list[torch.nn.Module]:
    module = run.strategy.lightning_module
    return [module.get_submodule(name) for name in run.strategy.plan.block_names]


@pytest.mark.parametrize("pays", [True, False])
def test_the_first_steps_plan_decides_whether_the_blocks_compile(compiles, monkeypatch, pays):
    """Mutation tried: setup leaving ``"auto"``'s blind default (no ``compile_at_first_step``) compiles at setup
    whatever the plan says, and fails the ``pays=False`` case."""
    decided = []

    def rule(inputs, settings_, rates):
        decided.append(inputs.batch_scale)
        return pays, "the test's answer"

    monkeypatch.setattr(resolved, "compile_pays", rule)
    run = fit_streamed(Classifier(), VitScaleStrategy(kernels="auto"))
    blocks = blocks_of(run)
    assert decided, "the first step's plan was not consulted"
    assert [is_compiled(block) for block in blocks] == [pays] * len(blocks) and len(compiles) == pays * len(blocks)
    line = run.strategy.plan.kernels["compiled blocks"]
    assert line.endswith("(the test's answer; decided at the first training step)")
    assert line.startswith(f"{type(blocks[0]).__name__} x{len(blocks)}" if pays else "off")


def test_a_batch_at_setup_decides_there_and_a_users_policy_is_kept(compiles, monkeypatch):
    decided_again = lambda *args: pytest.fail("decided again at the first step")  # noqa: E731
    monkeypatch.setattr(deferred_compile, "compile_choice", decided_again)
    L.seed_everything(0, verbose=False)
    module = Classifier()  # a map-style loader: the batch is read at setup, the rule applied there
    run = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(kernels="auto"), max_steps=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=0)
    run.fit(module, loader(16, batch_size=4))
    assert COMPILE_AT_FIRST_STEP not in run.strategy.plan.summary()
    own = fit_streamed(Classifier(), VitScaleStrategy(kernels=KernelPolicy(compile_blocks=True)))
    assert all(is_compiled(block) for block in blocks_of(own))  # compiled at setup, as asked


class GrowingBatches(torch.utils.data.IterableDataset):
    """Streamed batches of 2, then 8, then 4 (a ramp-up, then a smaller tail)."""

    def __iter__(self):
        images, labels = random_images(64).tensors
        start = 0
        for size in (2, 2, 8, 8, 8, 4):
            yield images[start:start + size], labels[start:start + size]
            start += size


@pytest.mark.parametrize("pays_from", [4.0, None])  # the first step's measured batch (2) scaled by 4: batch 8
def test_blocks_left_eager_compile_at_the_first_step_of_a_batch_where_it_pays(compiles, monkeypatch, pays_from):
    """Decided at the first step (batch 2: eager), again once at the first step of batch 8 (the first step's plan
    scaled to it), never for a smaller batch. Mutations tried: no re-decision (``DeferredCompile.if_the_batch_grew``
    returning at once) fails ``pays_from=4.0``; re-deciding at every step fails the count of decisions."""
    decided: list[float] = []

    def rule(inputs, settings_, rates):
        decided.append(inputs.batch_scale)
        return pays_from is not None and inputs.batch_scale >= pays_from, f"scale {inputs.batch_scale:g}"

    monkeypatch.setattr(resolved, "compile_pays", rule)
    L.seed_everything(0, verbose=False)
    run = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(kernels="auto"), precision="bf16-mixed",
                    max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    run.fit(Classifier(), torch.utils.data.DataLoader(GrowingBatches(), batch_size=None))
    blocks = blocks_of(run)
    assert decided == [1.0, 4.0]  # the first step's plan as measured (batch 2), then scaled to batch 8, once
    assert [is_compiled(block) for block in blocks] == [pays_from is not None] * len(blocks)
    line = run.strategy.plan.kernels["compiled blocks"]
    if pays_from is None:
        assert line == "off (scale 1; decided at the first training step)"
    else:
        assert line.endswith("(scale 4; decided at the first step of batch 8)") and len(compiles) == len(blocks)
