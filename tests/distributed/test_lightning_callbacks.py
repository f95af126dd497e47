"""Lightning's own callbacks, Trainer flags and overridden hooks under ``VitScaleStrategy()``: each run as under
``strategy="ddp"``, losses, weights and what the callback recorded, bit for bit (fp32), on one rank (its compute
copies) and on 2 ranks (FSDP2's path); clipping by norm on 2 ranks within float rounding (see the test).

Mutations seen failing: the sharded clipping norm taken from each rank's own shards (``hooks_overridden`` on 2
ranks); one rank's norm as a sum of squares (``hooks_overridden`` on one rank); the optimizers' state not loaded
from the sharded checkpoint (every ``exception_*`` resume)."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

SCRIPT = "tests/distributed/scripts/lightning_callbacks.py"
STOPS = ("step_start", "after_forward", "after_backward", "before_optimizer_step", "validation")
COMPARED = (
    "accumulation_scheduler", "early_stopping", "plateau_and_learning_rate_monitor",
    *(f"exception_{stop}" for stop in STOPS), "prediction_writer", "model_summary", "throughput_and_spikes",
    "hooks_overridden", "anomaly_detection_and_profiler", "overfit_batches", "ema_weight_averaging",
    "reloaded_dataloaders",
)


@pytest.fixture(scope="module", params=[1, 2], ids=["1 rank", "2 ranks"])
def runs(request, tmp_path_factory) -> list[dict]:
    scenarios = ",".join(f"{name}/{strategy}" for name in COMPARED for strategy in ("ddp", "vitscale"))
    return launch_ranks(tmp_path_factory, "lightning_callbacks", SCRIPT, scenarios, nprocs=request.param,
                        timeout=300)[1]


@pytest.mark.parametrize("scenario", COMPARED)
def test_as_under_ddp(runs, scenario):
    """``GradientAccumulationScheduler``; ``EarlyStopping`` (the epoch it stops at); ``ReduceLROnPlateau`` with
    ``LearningRateMonitor`` (the learning rate reached, the rows logged); ``OnExceptionCheckpoint`` at each place an
    error can stop a step, then a run resumed from its file; ``BasePredictionWriter`` (each rank's predictions and
    indices); ``ModelSummary`` (counts, size, rows); ``ThroughputMonitor`` with ``SpikeDetection``; a warm-up in
    ``optimizer_step``, ``optimizer_zero_grad(set_to_none=False)`` and clipping in ``configure_gradient_clipping``;
    ``detect_anomaly`` with the simple profiler; ``overfit_batches``; ``EMAWeightAveraging``;
    ``reload_dataloaders_every_n_epochs``."""
    for rank in runs:
        ours, ddp = rank[f"{scenario}/vitscale"], rank[f"{scenario}/ddp"]
        assert ours["losses"] and ours["weights"]
        if scenario == "hooks_overridden" and len(runs) == 2:
            # The clipping norm on 2 ranks is summed over each rank's shards, DDP's over whole gradients: the same
            # norm but for float rounding, which depends on the CPU's kernels (bit for bit on earlier CI machines,
            # 1.8e-9 apart in a parameter's sum on an AMD EPYC). AdamW divides by sqrt(v), so where a bias's
            # gradient is near zero that rounding grows: 2.3e-5 in a bias's sum on an AVX-512 EPYC (2026-12-07),
            # and the losses 2 float32 steps apart at most (1.4e-7). So: losses within 1e-6; sums within 1e-7 or
            # 1e-4 (a hundredth of one element's AdamW step at lr 1e-2). The mutation (a rank's own shards' norm):
            # losses 5e-3 apart, sums 0.12.
            assert ours["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
            assert ours["weights"] == pytest.approx(ddp["weights"], rel=1e-7, abs=1e-4)
            continue
        assert ours == ddp
