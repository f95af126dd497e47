"""GPU checks (NCCL, CUDA bf16): skipped without CUDA; run them on the device machine when a task has one."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_vitscale import VitScaleStrategy, measure_state_bytes
from tests.helpers.models import Classifier, loader
from tests.helpers.recording import DtypeRecorder, linear_bf16_share

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def fit(strategy, precision: str, steps: int = 6) -> tuple[Classifier, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = Classifier("timm")
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, precision=precision, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(model, loader(n=64))
    return model, trainer


def test_fp32_matches_single_device_on_cuda():
    reference, _ = fit("auto", "32-true")
    ours, trainer = fit(VitScaleStrategy(), "32-true")
    assert trainer.strategy.root_device.type == "cuda"
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(reference.losses), rtol=1e-4, atol=1e-5)


def test_bf16_mixed_is_o2_with_fp32_norms_on_cuda():
    class Recorded(Classifier):
        def training_step(self, batch, batch_idx):
            with self.recorder:
                return super().training_step(batch, batch_idx)

    model = Recorded("timm")
    model.recorder = DtypeRecorder()
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=VitScaleStrategy(), precision="bf16-mixed", max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, loader(n=32))
    calls = model.recorder.calls
    assert linear_bf16_share(calls) >= 0.9
    assert {(x, w) for op, x, w in calls if op == "layer_norm"} == {("torch.float32", "torch.float32")}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(model.losses)))
    assert measure_state_bytes(model, trainer.optimizers).optimizer_local > 0


@pytest.mark.parametrize("case", ["l2-before", "ortho-before"])
def test_a_term_on_the_shards_taken_before_the_forward_trains_as_on_the_plain_trainer_on_cuda(case):
    """The term backpropagates into the shards after every unit, while FSDP2's reductions on their own streams may
    still write those gradients (``sharding/direct_gradients.py``: the compute stream waits for them first)."""
    from tests.helpers.penalties import fit_penalty

    plain = fit_penalty(case, "auto", accelerator="cuda")
    ours = fit_penalty(case, VitScaleStrategy(priority="memory"), accelerator="cuda", use_distributed_sampler=False)
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses), rtol=1e-4, atol=1e-5)


def test_timm_s_ema_made_in_init_moves_as_on_the_plain_trainer_on_cuda():
    """timm's ``ModelEmaV3`` updates ``ema.state_dict()``'s values in place: gathered host copies here, written back
    into the CUDA shards (``checkpoint/state_dict_writes.py``)."""
    from tests.helpers.collective_habits import WithEma

    models = {}
    runs = (("plain", "auto", {}), ("ours", VitScaleStrategy(), {"use_distributed_sampler": False}))
    for name, strategy, extra in runs:
        models[name] = model = WithEma("timm")
        L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=4, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  **extra).fit(model)
    plain, ours = models["plain"].ema.state_dict(), models["ours"].ema.state_dict()
    for key, value in plain.items():
        torch.testing.assert_close(ours[key].cpu(), value.cpu(), rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("priority", ["speed", "memory"])
def test_validate_before_fit_runs_in_inference_mode_then_trains_as_the_plain_trainer_on_cuda(priority):
    """Lightning runs ``trainer.validate`` in inference mode on NCCL: the first gather of every unit made FSDP2's
    gathered parameters inference tensors, and the fit after it failed at its first step
    (``sharding/first_gathers.py``; on CPU, tests/distributed/test_dropin.py lifts Lightning's gloo
    exception to run the same path)."""
    runs = {}
    for name, strategy, extra in (("plain", "auto", {}),
                                  ("ours", VitScaleStrategy(priority=priority), {"use_distributed_sampler": False})):
        L.seed_everything(0, verbose=False)
        model, modes = Classifier("timm"), []
        model.on_validation_batch_start = lambda *_, seen=modes: seen.append(torch.is_inference_mode_enabled())
        trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=4, limit_val_batches=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, **extra)
        val_loss = trainer.validate(model, loader(n=16), verbose=False)[0]["val_loss"]
        trainer.fit(model, loader(n=32))
        runs[name] = (val_loss, model.losses, modes)
    (plain_val, plain_losses, plain_modes), (val, losses, modes) = runs["plain"], runs["ours"]
    assert plain_modes == modes == [True, True]
    assert val == pytest.approx(plain_val, rel=1e-4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-4, atol=1e-5)
