"""Trainer(precision=...) translation and bad accelerators, asserted by message."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import Accelerator

import lightning_vitscale  # noqa: F401
from lightning_vitscale import VitScalePrecision, VitScaleStrategy
from lightning_vitscale.policies import resolve_flag


def trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize("flag", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_flag_becomes_our_plugin(flag):
    t = trainer(strategy="vitscale", precision=flag)
    assert isinstance(t.strategy.precision_plugin, VitScalePrecision)
    assert t.strategy.precision_plugin.precision == flag


def test_fp16_on_cpu_through_the_plugin():
    # Lightning's connector turns precision="16-mixed" into "bf16-mixed" on CPU for every strategy;
    # the plugin form keeps fp16 (with our sharded scaler).
    t = trainer(strategy="vitscale", plugins=[VitScalePrecision("16-mixed")])
    assert t.strategy.precision_plugin.precision == "16-mixed"
    assert t.strategy.precision_plugin.scaler is not None


def test_instance_and_registry_name_are_equivalent():
    assert type(trainer(strategy=VitScaleStrategy()).strategy) is type(trainer(strategy="vitscale").strategy)


@pytest.mark.parametrize("flag", ["16-true", "64-true"])
def test_unsupported_flag_names_the_choices(flag):
    with pytest.raises(TypeError, match="32-true, bf16-mixed, bf16-true, 16-mixed"):
        trainer(strategy="vitscale", precision=flag)


def test_resolve_rejects_unknown():
    with pytest.raises(ValueError, match="does not support precision='fp8'"):
        resolve_flag("fp8")


def test_o2_dtypes():
    dtypes = resolve_flag("bf16-mixed")
    assert (dtypes.master, dtypes.compute, dtypes.reduce) == (torch.float32, torch.bfloat16, torch.float32)
    assert resolve_flag("bf16-true").master == torch.bfloat16


class _OtherAccelerator(Accelerator):
    def setup_device(self, device): ...
    def teardown(self): ...
    @staticmethod
    def parse_devices(devices): return devices
    @staticmethod
    def get_parallel_devices(devices): return [torch.device("cpu")]
    @staticmethod
    def auto_device_count(): return 1
    @staticmethod
    def is_available(): return True
    def get_device_stats(self, device): return {}
    @classmethod
    def name(cls): return "other"


def test_unsupported_accelerator_is_refused_early():
    strategy = VitScaleStrategy()
    strategy.accelerator = _OtherAccelerator()
    with pytest.raises(ValueError, match="runs on accelerator='cpu' .* or 'cuda'"):
        strategy._configure_launcher()


def test_unspecified_foreach_becomes_foreach_but_user_choice_is_kept():
    from lightning_vitscale.kernels import prefer_foreach

    p = [torch.nn.Parameter(torch.ones(2))]
    default, explicit, fused = (
        torch.optim.AdamW(p), torch.optim.AdamW(p, foreach=False), torch.optim.AdamW(p, fused=True)
    )
    prefer_foreach([default, explicit, fused])
    assert default.param_groups[0]["foreach"] is True
    assert explicit.param_groups[0]["foreach"] is False
    assert not fused.param_groups[0].get("foreach")


def test_norm_selector_forms():
    from torch import nn

    from lightning_vitscale.precision import _norm_predicate

    assert _norm_predicate(False) is None
    assert _norm_predicate({nn.LayerNorm})("x", nn.LayerNorm(2))
    assert not _norm_predicate({nn.LayerNorm})("x", nn.GroupNorm(1, 2))
    with pytest.raises(TypeError, match="`norms` must be"):
        _norm_predicate("layernorm")  # type: ignore[arg-type]
