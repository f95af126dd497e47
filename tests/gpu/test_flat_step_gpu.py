"""On one GPU each param group steps as one flat tensor (``precision/flat_step.py``) with the steps GPU users take:
AdamW's foreach step and its fused one (counters on the device), bf16 compute; bit for bit the per-tensor step."""

from __future__ import annotations

import pytest
import torch

from lightning_vitscale.precision import flat_step
from tests.unit.precision.test_flat_step import Grouped, assert_equal, fit, state_is_flat

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer", ["AdamW", "AdamW fused"])
def test_param_groups_step_flat_on_cuda_bit_for_bit_as_per_tensor(optimizer, monkeypatch):
    module, run, flat = fit(lambda: Grouped(optimizer), accelerator="cuda")
    assert state_is_flat(run)
    if optimizer == "AdamW fused":
        assert all(state["step"].device.type == "cuda" for state in run.optimizers[0].state.values())
    monkeypatch.setattr(flat_step, "lay_out", lambda optimizers, eligible: [])
    reference, _, expected = fit(lambda: Grouped(optimizer), accelerator="cuda")
    assert module.losses == reference.losses
    assert_equal(flat, expected)
