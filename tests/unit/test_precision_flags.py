"""Trainer(precision=...) translation and bad accelerators, asserted by message."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import Accelerator

import lightning_vitscale  # noqa: F401
from lightning_vitscale import VitScalePrecision, VitScaleStrategy
from lightning_vitscale.precision import resolve_flag


def trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize("flag", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_flag_becomes_our_plugin(flag):
    t = trainer(strategy="vitscale", precision=flag)
    assert isinstance(t.strategy.precision_plugin, VitScalePrecision)
    assert t.strategy.precision_plugin.precision == flag


def test_instance_and_registry_name_are_equivalent():
    assert type(trainer(strategy=VitScaleStrategy()).strategy) is type(trainer(strategy="vitscale").strategy)


@pytest.mark.parametrize("flag", ["16-true", "64-true"])
def test_unsupported_flag_names_the_choices(flag):
    with pytest.raises(TypeError, match="32-true, bf16-mixed, bf16-true"):
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
