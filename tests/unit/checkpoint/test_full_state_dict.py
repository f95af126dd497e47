"""``state_dict()`` / ``load_state_dict()`` of a sharded model (world-size-1 mesh): DDP's plain full tensors outside
the strategy's own code, FSDP2's DTensor shards inside ``sharded_state_dicts()``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_vitscale.checkpoint import full_state_dict
from lightning_vitscale.checkpoint.full_state_dict import StateDictGatherError, sharded_state_dicts
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import ParallelConfig
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from tests.helpers.models import EncoderClassifier, SmallResNet


def sharded(mesh, precision: str = "32-true", install: bool = True, build=None):
    torch.manual_seed(0)
    model = (build or (lambda: EncoderClassifier(dim=32, depth=2, dropout=0.0)))().eval()
    reference = copy.deepcopy(model)
    root = OuterUnit(model)
    parallelize(root, model, mesh, ParallelConfig(), resolve_flag(precision), torch.device("cpu"))
    root.enable_calls_outside_steps()
    if install:
        full_state_dict.install(model, root)
    return root, model, reference


def assert_same_state(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, value in got.items():
        assert type(value) is torch.Tensor and value.device.type == "cpu", key
        assert value.dtype == expected[key].dtype and torch.equal(value, expected[key]), key


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_state_dict_is_the_plain_models(mesh, precision):
    _, model, reference = sharded(mesh, precision)
    assert_same_state(model.state_dict(), reference.state_dict())
    assert_same_state(model.head.state_dict(), reference.head.state_dict())  # a submodule alone
    block = model.encoder.layers[0]  # an FSDP unit of its own
    assert_same_state(block.state_dict(prefix="x."), reference.encoder.layers[0].state_dict(prefix="x."))


def test_without_the_hooks_state_dict_holds_shards(mesh):
    _, model, _ = sharded(mesh, install=False)
    assert any(isinstance(v, DTensor) for v in model.state_dict().values())


def test_strategy_code_and_keep_vars_get_the_shards(mesh):
    _, model, _ = sharded(mesh)
    with sharded_state_dicts():
        assert isinstance(model.state_dict()["head.weight"], DTensor)
    assert model.state_dict(keep_vars=True)["head.weight"] is model.head.weight  # the live parameter
    assert type(model.state_dict()["head.weight"]) is torch.Tensor  # the next call outside gathers again


def test_state_dict_after_a_call_that_kept_the_outer_unit_gathered(mesh):
    root, model, reference = sharded(mesh)
    model.head(torch.ones(2, 32))  # gradients on: the outer unit stays gathered until the next step
    assert_same_state(model.state_dict(), reference.state_dict())
    root.release()


def test_load_state_dict_of_plain_weights(mesh):
    root, model, _ = sharded(mesh)
    torch.manual_seed(1)
    other = EncoderClassifier(dim=32, depth=2, dropout=0.0).eval()
    weights = other.state_dict()
    kept = {k: v.clone() for k, v in weights.items()}
    assert str(model.load_state_dict(weights)) == "<All keys matched successfully>"
    assert all(isinstance(p, DTensor) for p in model.parameters())  # still sharded, the optimizer's objects
    assert_same_state(model.state_dict(), other.state_dict())
    assert all(torch.equal(weights[k], kept[k]) for k in kept)  # the caller's dict is untouched
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), other(x))
    model.head.load_state_dict({"weight": torch.ones(10, 32), "bias": torch.zeros(10)})  # a submodule alone
    assert torch.equal(model.head.weight.full_tensor(), torch.ones(10, 32))


def test_load_errors_are_torchs_own(mesh):
    _, model, reference = sharded(mesh)
    weights = reference.state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for head.weight: copying a param with shape"):
        model.load_state_dict(dict(weights, **{"head.weight": torch.zeros(3, 3)}))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"head.bias\""):
        model.load_state_dict({k: v for k, v in weights.items() if k != "head.bias"})
    result = model.load_state_dict({k: v for k, v in weights.items() if k != "head.bias"}, strict=False)
    assert result.missing_keys == ["head.bias"] and not result.unexpected_keys


def test_failed_gather_names_the_cause_and_the_fixes(mesh, monkeypatch):
    _, model, _ = sharded(mesh)

    def times_out(self):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    monkeypatch.setattr(DTensor, "full_tensor", times_out)
    with pytest.raises(StateDictGatherError, match="every rank must join.*Timed out waiting.*save_checkpoint"):
        model.state_dict()
    monkeypatch.undo()
    assert type(model.state_dict()["head.weight"]) is torch.Tensor  # the failed call left no state behind


def test_load_state_dict_after_a_call_that_kept_the_outer_unit_gathered(mesh):
    root, model, reference = sharded(mesh)
    root(torch.randn(2, 3, 32, 32))  # a step: FSDP's lazy init registers its own state-dict hooks
    root.release()
    model.head(torch.ones(2, 32))  # gradients on: the outer unit stays gathered until the next step
    weights = {k: v + 1 for k, v in reference.state_dict().items()}
    model.load_state_dict(weights)
    assert_same_state(model.state_dict(), weights)
    root.release()
    x = torch.randn(2, 3, 32, 32)
    reference.load_state_dict(weights)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_a_state_dict_that_raised_midway_leaves_the_next_call_gathered(mesh):
    _, model, reference = sharded(mesh)

    def fails(module, prefix, keep_vars):
        raise OSError("a user's hook failed")

    handle = model.encoder.register_state_dict_pre_hook(fails)
    with pytest.raises(OSError):
        model.state_dict()  # stops between the outermost module's pre- and post-hook
    handle.remove()
    assert model.state_dict(keep_vars=True)["head.weight"] is model.head.weight  # not gathered by the stale call
    assert_same_state(model.head.state_dict(), reference.head.state_dict())


def test_hybrid_mesh_state_dict_and_load(mesh):
    """A 2-D (replicate, shard) mesh: DTensors with two placements gather and load the same way."""
    from torch.distributed.device_mesh import init_device_mesh

    hybrid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    root, model, reference = sharded(hybrid)
    assert model.head.weight.device_mesh.ndim == 2
    assert_same_state(model.state_dict(), reference.state_dict())
    weights = {k: v * 2 for k, v in reference.state_dict().items()}
    model.load_state_dict(weights)
    assert_same_state(model.state_dict(), weights)


def test_unsharded_buffers_come_along(mesh):
    """BatchNorm statistics (FSDP leaves buffers whole) are in the state dict and load back, as under DDP."""
    _, model, reference = sharded(mesh, build=lambda: SmallResNet(channels=8, depth=2))
    model.train()
    reference.train()
    x = torch.randn(4, 3, 32, 32)
    model(x)  # updates the running statistics
    reference(x)
    state = model.state_dict()
    assert any(k.endswith("num_batches_tracked") for k in state)
    assert_same_state(state, reference.state_dict())
    fresh = SmallResNet(channels=8, depth=2)
    fresh.load_state_dict(state)
    model.load_state_dict({k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in state.items()})
    assert all(float(v.abs().sum()) == 0 for k, v in model.state_dict().items() if v.is_floating_point())


def test_saved_after_fit_loads_into_a_plain_model(mesh, tmp_path):
    """The DDP habit on one device: ``torch.save(model.state_dict())`` after ``fit``, loaded by a plain script."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_vitscale import VitScaleStrategy
    from lightning_vitscale.cli.demo import TinyViT, generated_images

    model = TinyViT(dim=32, depth=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(), max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model, DataLoader(generated_images(32), batch_size=16))
    assert any(isinstance(p, DTensor) for p in model.parameters())
    torch.save(model.state_dict(), tmp_path / "final.pt")
    fresh = TinyViT(dim=32, depth=2)
    assert str(fresh.load_state_dict(torch.load(tmp_path / "final.pt"))) == "<All keys matched successfully>"
    assert_same_state(fresh.state_dict(), {k: v.full_tensor() for k, v in model.state_dict(keep_vars=True).items()})


def test_modules_whose_hash_follows_their_state_stay_trackable():
    """torchmetrics metrics hash by their state tensors. torch's load-state-dict hook wrapper keeps a plain
    ``weakref.ref(module)`` alive, and a weakref caches its referent's first hash: after the metric's next update
    every ``WeakKeyDictionary`` lookup of the metric missed, so ``ModuleTracker`` (under ``FlopCounterMode``)
    raised ``KeyError`` in the examples' training steps. Modules with nothing sharded below get no hooks."""
    from torch.utils.module_tracker import ModuleTracker
    from torchmetrics.classification import MulticlassAccuracy

    model = torch.nn.Module()
    model.linear, model.accuracy = torch.nn.Linear(4, 3), MulticlassAccuracy(num_classes=3)
    full_state_dict.install(model)
    target = torch.tensor([0, 2])
    for _ in range(2):  # the first pass hashes the metric, the update changes its hash, the second pass looks it up
        with ModuleTracker():
            model.accuracy(model.linear(torch.randn(2, 4)).argmax(-1), target)
    assert model.accuracy.update_count == 2
