"""DDP habits the strategy takes over: torch.compile'd modules, sync_batchnorm, averaged copies (no ranks launched)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.utilities.compile import _maybe_unwrap_optimized, _verify_strategy_supports_compile
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.averaging.lightning_callbacks import shard_averaged_copies, shard_like
from lightning_vitscale.discovery.norms import is_normalization
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import ParallelConfig
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from lightning_vitscale.sharding.sync_batchnorm import apply_sync_batchnorm
from tests.helpers.models import Classifier, EncoderClassifier, SmallResNet


class Steps(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return self(batch).sum()


def test_compiled_module_is_taken_over_before_lightning_refuses_it():
    model = Steps()
    plain_step = model.training_step
    compiled = torch.compile(model, backend="eager")
    unwrapped = _maybe_unwrap_optimized(compiled)  # what Trainer.fit does first
    with pytest.raises(RuntimeError, match="incompatible with the current strategy"):
        _verify_strategy_supports_compile(unwrapped, L.pytorch.strategies.ModelParallelStrategy())
    strategy = VitScaleStrategy()
    strategy._lightning_module = unwrapped  # what Trainer.fit does next
    _verify_strategy_supports_compile(unwrapped, strategy)  # accepted now
    assert strategy.lightning_module is model
    assert model.training_step == plain_step and model._compiler_ctx is None  # the whole step is not compiled
    assert strategy._compiler is compiled.dynamo_ctx  # the blocks get the user's compile settings


def test_sync_batchnorm_converts_where_torch_runs_it():
    model = Classifier("resnet")
    batchnorms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    apply_sync_batchnorm(TorchSyncBatchNorm(), model, torch.device("cuda"))  # conversion needs no GPU
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules()) == batchnorms == 9
    assert all(is_normalization(n, m) for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm))


def test_sync_batchnorm_refused_on_cpu_and_a_no_op_without_batchnorm():
    model = SmallResNet()
    with pytest.raises(ValueError, match=r"9 BatchNorm layer\(s\) of SmallResNet .*accelerator='cuda'"):
        apply_sync_batchnorm(TorchSyncBatchNorm(), model, torch.device("cpu"))
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    encoder = EncoderClassifier()
    assert apply_sync_batchnorm(TorchSyncBatchNorm(), encoder, torch.device("cpu")) is encoder  # as DDP: no BN
    assert apply_sync_batchnorm(None, model, torch.device("cpu")) is model


def test_averaged_copy_is_sharded_like_the_model_with_its_own_values(mesh):
    torch.manual_seed(0)
    model = EncoderClassifier(dim=32, depth=2)
    averaged = copy.deepcopy(model)
    with torch.no_grad():
        for p in averaged.parameters():
            p.add_(1.0)  # the copy's values are its own, not the model's
    expected = {name: p.detach().clone() for name, p in averaged.named_parameters()}
    parallelize(OuterUnit(model), model, mesh, ParallelConfig(), resolve_flag("32-true"), torch.device("cpu"))
    shard_like(averaged, model)
    live = dict(model.named_parameters())
    for name, p in averaged.named_parameters():
        assert isinstance(p, DTensor) and p.placements == live[name].placements, name
        assert torch.equal(p.full_tensor(), expected[name]), name
    # The callbacks pair parameters by position: the order is unchanged.
    assert [n for n, _ in averaged.named_parameters()] == list(expected) == list(live)


def test_averaging_checkpoints_are_refused_not_silently_partial(mesh):
    model = EncoderClassifier(dim=32, depth=2)
    callback = WeightAveraging()
    callback._average_model = AveragedModel(copy.deepcopy(model))
    parallelize(OuterUnit(model), model, mesh, ParallelConfig(), resolve_flag("32-true"), torch.device("cpu"))
    with pytest.raises(ValueError, match="enable_checkpointing=False.*ShardedEMA"):
        shard_averaged_copies([callback], model, torch.device("cpu"), checkpointing=True)
    assert shard_averaged_copies([callback], model, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="cannot be checkpointed under VitScaleStrategy"):
        callback.on_save_checkpoint(None, model, {})  # a manual trainer.save_checkpoint
