"""The non-finite guard with a fused optimizer, through ``Trainer.fit`` on one process: the skip is decided by the
fused step itself (``found_inf``), the host reads the decision a step later (no device sync per step on a GPU).

Mutations seen failing: the plugin taking the synced path for fused optimizers (``should_skip`` refused below); the
``found_inf`` not handed to the step (the NaN step changes the weights); no ``settle`` at the end of fit (the last
step's skip uncounted); no ``close`` at teardown (a failed fit's pending step counted by the next fit); ``close``
raising the stop (the failed fit's own error hidden).
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lightning_vitscale import NonFiniteTrainingError, VitScalePrecision, VitScaleStrategy
from lightning_vitscale.precision import NonFiniteGuard
from tests.helpers.models import Classifier, loader


class NaNAt(Classifier):
    """The loss is NaN at the listed batches; records whether each batch changed the weights and Adam's counters."""

    def __init__(self, nan_batches: set[int], fused: bool = True) -> None:
        super().__init__("encoder")
        self.nan_batches, self.fused = nan_batches, fused
        self.changed: list[bool] = []
        self.counters: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx in self.nan_batches else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.05, fused=self.fused)

    def on_train_batch_start(self, batch, batch_idx):
        self.before = [p.to_local().detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.changed.append(any(not torch.equal(a, p.to_local()) for a, p in zip(self.before, self.parameters())))
        steps = [float(s["step"]) for s in self.trainer.optimizers[0].state.values() if "step" in s]
        self.counters.append(max(steps, default=0.0))


def fit(model: NaNAt, steps: int, max_skipped: int = 3, accelerator: str = "cpu") -> VitScalePrecision:
    plugin = VitScalePrecision("bf16-mixed", max_skipped_steps=max_skipped)
    strategy = VitScaleStrategy(kernels="eager")  # the optimizer fused by the model, not by kernels="auto"
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy, plugins=[plugin], max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader(n=64))
    return plugin


@pytest.fixture
def no_synced_guard(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a fused optimizer's step read the guard's decision on the host")

    monkeypatch.setattr(NonFiniteGuard, "should_skip", refused)


def test_a_fused_step_skips_the_non_finite_step_on_the_device(no_synced_guard):
    model = NaNAt({2})
    with pytest.warns(UserWarning, match="global step 2 .*optimizer step skipped on every rank"):
        plugin = fit(model, steps=5)
    assert model.changed == [True, True, False, True, True]
    assert model.counters == [1.0, 2.0, 2.0, 3.0, 4.0]  # the skipped step did not count in Adam's bias correction
    assert plugin.nonfinite_guard.skipped == 1 and plugin.nonfinite_guard.decided_on_device == 5
    assert all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())


def test_the_last_step_skipped_is_counted_when_fit_ends(no_synced_guard):
    model = NaNAt({3})
    with pytest.warns(UserWarning, match="global step 3"):
        plugin = fit(model, steps=4)
    assert model.changed == [True, True, True, False] and plugin.nonfinite_guard.skipped == 1


def test_k_non_finite_steps_in_a_row_stop_the_run_one_step_later_with_weights_finite(no_synced_guard):
    model = NaNAt({1, 2, 3, 4})
    with pytest.warns(UserWarning), pytest.raises(NonFiniteTrainingError, match=r"2 optimizer steps in a row \(the "
                                                                                r"last at global step 2: loss"):
        fit(model, steps=5, max_skipped=2)
    assert model.changed == [True, False, False]  # batch 3 stopped in its optimizer step, nothing applied
    assert all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())


def test_a_foreach_optimizer_keeps_the_synced_guard():
    model = NaNAt({2}, fused=False)
    with pytest.warns(UserWarning, match="global step 2"):
        plugin = fit(model, steps=3)
    assert model.changed == [True, True, False] and plugin.nonfinite_guard.skipped == 1
    assert plugin.nonfinite_guard.decided_on_device == 0


class Interrupted(Exception):
    pass


class StopsAt(NaNAt):
    """Raises at the start of one batch: the step before it was decided on the device and not read yet."""

    def __init__(self, nan_batches: set[int], stop_at: int | None) -> None:
        super().__init__(nan_batches)
        self.stop_at = stop_at

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == self.stop_at:
            raise Interrupted
        super().on_train_batch_start(batch, batch_idx)


def test_a_fit_ended_by_an_exception_counts_its_pending_step_and_leaves_none_to_the_next_fit(no_synced_guard):
    plugin = VitScalePrecision("bf16-mixed", max_skipped_steps=3)

    def fit_with(model: NaNAt, steps: int) -> None:
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(kernels="eager"),
                            plugins=[plugin], max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, loader(n=64))

    with pytest.warns(UserWarning, match="global step 2 "), pytest.raises(Interrupted):
        fit_with(StopsAt({2}, stop_at=3), steps=5)  # step 2's NaN is read as the fit tears down
    guard = plugin.nonfinite_guard
    assert guard.skipped == 1 and guard.consecutive == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Non-finite values")  # a stale step 2 would warn here
        fit_with(StopsAt(set(), stop_at=None), steps=2)
    assert guard.skipped == 1 and guard.consecutive == 0


def test_a_stop_reached_by_the_pending_step_of_a_failed_fit_does_not_hide_its_error(no_synced_guard):
    plugin = VitScalePrecision("bf16-mixed", max_skipped_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(kernels="eager"), plugins=[plugin],
                        max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.warns(UserWarning, match="global step 2 .*2 in a row"), pytest.raises(Interrupted):
        trainer.fit(StopsAt({1, 2}, stop_at=3), loader(n=64))
    assert plugin.nonfinite_guard.skipped == 2
