"""The non-finite step guard on one process: its default per precision flag, its settings, and when it stops."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _CountOps(TorchDispatchMode):
    """How many ATen ops run (each a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _gradients(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(7, generator=g).to(torch.bfloat16 if i % 3 == 0 else torch.float32) for i in range(n)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 1, 29])  # a bf16 gradient, an fp32 one, the last one
def test_any_non_finite_gradient_of_any_dtype_is_found_and_no_value_changes(bad, where):
    grads = _gradients(30)
    grads[where][3] = bad
    grads[5][0] = -0.0
    before = [g.clone() for g in grads]
    guard = NonFiniteGuard()
    with pytest.warns(UserWarning, match="gradients on rank"):
        assert guard.should_skip(torch.tensor(1.0), grads, step=0) is True
    for g, b in zip(grads, before):
        assert torch.equal(g.isnan(), b.isnan()) and torch.equal(g.nan_to_num(), b.nan_to_num())
    assert torch.signbit(grads[5][0])  # -0.0 stays -0.0
    assert guard.should_skip(torch.tensor(1.0), _gradients(30), step=1) is False


def test_the_gradient_check_runs_a_fixed_number_of_ops_whatever_the_number_of_parameters():
    """One fused check per device and dtype: ViT-H's ~400 gradients cost what 4 do (on the H200 the per-tensor
    check launched ~1,600 kernels a step)."""
    counts = []
    for n in (4, 400):
        grads = _gradients(n)
        with _CountOps() as counter:
            NonFiniteGuard().should_skip(torch.tensor(1.0), grads, step=0)
        counts.append(counter.ops)
    assert counts[0] == counts[1] < 40, counts


def test_skip_on_device_gives_found_inf_now_and_counts_at_the_next_call():
    """The fused path's decision stays on the device (``found_inf``); the host reads it one call later."""
    guard = NonFiniteGuard(max_consecutive=3)
    finite, nan, cpu = torch.tensor(1.0), torch.tensor(float("nan")), torch.device("cpu")
    found = guard.skip_on_device(nan, [torch.ones(3)], step=0, device=cpu)
    assert found.dtype == torch.float32 and found.item() == 1.0
    assert guard.skipped == 0  # not read yet
    with pytest.warns(UserWarning, match="at global step 0 .*skipped on every rank"):
        found = guard.skip_on_device(finite, [torch.tensor([1.0, float("inf")])], step=1, device=cpu)
    assert found.item() == 1.0 and guard.skipped == 1
    with pytest.warns(UserWarning, match="at global step 1 \\(gradients on rank"):
        guard.settle()
    assert guard.skipped == 2 and guard.consecutive == 2
    guard.settle()  # read once, not twice
    assert guard.skipped == 2


def test_skip_on_device_stops_one_call_after_the_last_of_k_in_a_row():
    guard = NonFiniteGuard(max_consecutive=2)
    nan, cpu = torch.tensor(float("nan")), torch.device("cpu")
    assert guard.skip_on_device(torch.tensor(1.0), [torch.ones(2)], step=0, device=cpu).item() == 0.0
    with pytest.warns(UserWarning):
        guard.skip_on_device(nan, [], step=1, device=cpu)
        guard.skip_on_device(nan, [], step=2, device=cpu)
    with pytest.raises(NonFiniteTrainingError, match=r"2 optimizer steps in a row \(the last at global step 2"):
        guard.skip_on_device(torch.tensor(1.0), [], step=3, device=cpu)
    guard.settle()  # nothing left to read after the stop
    assert guard.skipped == 2
