"""On one GPU the fused step skips a non-finite step on the device and the host reads the decision a step later,
through a pinned copy and an event recorded behind the step's own work (``precision/nonfinite.py``'s ``_Pending``:
the path CPU runs never take)."""

from __future__ import annotations

import pytest
import torch

from lightning_vitscale.precision import NonFiniteGuard
from tests.unit.precision.test_nonfinite_on_device import NaNAt, fit

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fused_step_on_cuda_skips_on_the_device_and_is_read_a_step_later(monkeypatch):
    pending = []
    skip_on_device = NonFiniteGuard.skip_on_device

    def recorded(self, *args, **kwargs):
        found = skip_on_device(self, *args, **kwargs)
        pending.append(self._pending[-1])
        return found

    monkeypatch.setattr(NonFiniteGuard, "skip_on_device", recorded)
    model = NaNAt({2})
    with pytest.warns(UserWarning, match="global step 2"):
        plugin = fit(model, steps=5, accelerator="cuda")
    assert len(pending) == 5 and all(p.done is not None and p.flags.is_pinned() for p in pending)
    assert model.changed == [True, True, False, True, True] and model.counters == [1.0, 2.0, 2.0, 3.0, 4.0]
    assert plugin.nonfinite_guard.skipped == 1
