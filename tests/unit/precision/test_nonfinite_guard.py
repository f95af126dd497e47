"""The non-finite step guard on one process: its default per precision flag, its settings, and when it stops."""

from __future__ import annotations

import pytest
import torch

from lightning_vitscale import NonFiniteTrainingError, VitScalePrecision
from lightning_vitscale.precision import NonFiniteGuard


@pytest.mark.parametrize(
    ("flag", "on", "gradients"),
    [("32-true", False, None), ("bf16-mixed", True, True), ("bf16-true", True, True), ("16-mixed", True, False)],
)
def test_on_by_default_for_reduced_precision_only(flag, on, gradients):
    guard = VitScalePrecision(flag).nonfinite_guard
    assert (guard is not None) is on
    if guard is not None:
        assert guard.check_gradients is gradients  # fp16: the scaler owns the gradients


def test_explicit_choice_wins_over_the_default():
    assert VitScalePrecision("32-true", skip_nonfinite=True).nonfinite_guard is not None
    assert VitScalePrecision("bf16-mixed", skip_nonfinite=False).nonfinite_guard is None


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_max_skipped_steps_is_refused_naming_it(value, error):
    with pytest.raises(error, match="max_consecutive must be"):
        VitScalePrecision("bf16-mixed", max_skipped_steps=value)


def test_skips_non_finite_steps_and_stops_after_k_in_a_row():
    guard = NonFiniteGuard(max_consecutive=2)
    finite, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    grads = [torch.ones(3)]
    assert guard.should_skip(finite, grads, step=0) is False
    with pytest.warns(UserWarning, match="optimizer step skipped on every rank"):
        assert guard.should_skip(finite, [torch.tensor([1.0, float("inf")])], step=1) is True  # gradient only
    assert guard.should_skip(finite, grads, step=2) is False  # a finite step resets the count
    with pytest.warns(UserWarning):
        assert guard.should_skip(nan, grads, step=3) is True
    stopped = r"2 optimizer steps in a row \(the last at global step 4: loss on rank\(s\) \[0\]\)"
    with pytest.raises(NonFiniteTrainingError, match=stopped):
        guard.should_skip(nan, grads, step=4)
    assert guard.skipped == 3


def test_loss_only_guard_leaves_gradients_to_the_scaler():
    guard = NonFiniteGuard(check_gradients=False)
    assert guard.should_skip(torch.tensor(1.0), [torch.tensor([float("inf")])], step=0) is False
