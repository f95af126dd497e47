"""``copy.deepcopy`` of a sharded model is DDP's: the plain module with whole parameters (``sharding/plain_copy.py``),
on the one-rank compute copies' path and on FSDP2's, after ``fit``, between steps and in the middle of a step.
Two ranks, against DDP: ``tests/distributed/test_dropin.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, random_images
from tests.unit.sharding.test_compute_copies import COPIES, fit, without_dropout

# FSDP2's path on one rank: every block its own unit, checkpointed, kept gathered between forward and backward.
FSDP_PATH = {"activation_checkpointing": True, "blocks_per_unit": 1, "reshard_after_forward": False}
LAYOUTS = pytest.mark.parametrize("layout", [COPIES, FSDP_PATH], ids=["compute copies", "fsdp2 units"])
PROBE = random_images(4, seed=7).tensors[0]


def strategy_leftovers(module: nn.Module) -> list[str]:
    """What a plain module never has: DTensors, hooks, the strategy's attributes, classes made by FSDP2 or the
    fp32 norms, instance forwards."""
    found = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    for name, sub in module.named_modules():
        plain_class = type(sub).__mro__[1] if "FSDP" in type(sub).__name__ or "_vitscale_norm_class" in vars(
            type(sub)) else type(sub)
        found += [f"{name}: class {type(sub).__name__}"] * (plain_class is not type(sub))
        found += [f"{name}.{key}" for key in vars(sub) if key.startswith(("_vitscale", "__composable", "_fsdp",
                                                                            "_is_fsdp", "forward", "__deepcopy__"))]
        found += [f"{name}.{key}" for key, value in vars(sub).items() if key.endswith("_hooks") and value]
    return found


def output(module: nn.Module) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        return module(PROBE)


@LAYOUTS
def test_a_deep_copy_after_fit_is_the_plain_module_with_whole_parameters(layout):
    """What DDP's ``copy.deepcopy(model)`` gives: the user's classes, plain fp32 parameters equal to
    ``model.state_dict()`` (DDP's), its forward; and the original trains on, sharded. Mutations tried: no class
    unwrapped (FSDP2 refuses the copy; the fp32 norm class stays); the strategy's hooks kept."""
    module = without_dropout(Classifier())
    fit(module, VitScaleStrategy(**layout), steps=2)
    state = module.state_dict()
    twin = copy.deepcopy(module)
    assert type(twin) is Classifier and strategy_leftovers(twin) == []
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in twin.parameters())
    assert list(twin.state_dict()) == list(state)
    assert all(torch.equal(twin.state_dict()[key], value) for key, value in state.items())
    live = {p._local_tensor.untyped_storage().data_ptr() for p in module.parameters()}
    assert not live & {p.untyped_storage().data_ptr() for p in twin.parameters()}  # its own memory, as DDP's copy
    plain = Classifier()
    plain.load_state_dict(state)
    assert torch.equal(output(twin), output(plain))
    child = copy.deepcopy(module.backbone)  # timm's ModelEmaV3(model.backbone)
    assert strategy_leftovers(child) == [] and torch.equal(output(child), output(plain.backbone))
    # The copy trains as a plain module; the original is untouched and trains on under the strategy.
    twin.train()
    nn.functional.cross_entropy(twin(PROBE), torch.zeros(4, dtype=torch.long)).backward()
    assert all(p.grad is not None for p in twin.parameters())
    assert all(isinstance(p, DTensor) for p in module.parameters()) and strategy_leftovers(module) != []
    fit(module, VitScaleStrategy(**layout), steps=2)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in module.losses[-2:])


class CopiedInTheStep(Classifier):
    """Deep-copies itself before the step's forward and between its forward and backward (the weights gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: dict[str, nn.Module] = {}

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 1:
            self.copies["before forward"] = copy.deepcopy(self)

    def on_before_backward(self, loss):
        if not self.copies.get("mid-step"):
            self.copies["mid-step"] = copy.deepcopy(self) if len(self.losses) == 2 else None


@LAYOUTS
def test_a_deep_copy_in_the_middle_of_a_step_holds_the_fp32_weights_not_the_gathered_bf16_ones(layout):
    """Between forward and backward the modules hold bf16 copies (or FSDP2's gathered bf16 parameters); DDP's copy
    there holds the fp32 weights, the same as before the forward. Mutation tried: gathered weights not mapped to
    their fp32 shards (the copy held bf16 values)."""
    module = without_dropout(CopiedInTheStep())
    fit(module, VitScaleStrategy(**layout), steps=3)
    before, mid = module.copies["before forward"], module.copies["mid-step"]
    for twin in (before, mid):
        assert strategy_leftovers(twin) == [] and {p.dtype for p in twin.parameters()} == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), mid.state_dict().values()))
    assert torch.equal(output(before), output(mid))


def test_a_meta_twin_of_a_sharded_model_keeps_its_stand_ins():
    """The planner's meta twin (``memory/twin.py``) passes meta stand-ins in deepcopy's memo: nothing is gathered
    for them, and the twin is on meta."""
    from lightning_vitscale.memory.twin import meta_twin

    module = without_dropout(Classifier())
    fit(module, VitScaleStrategy(**COPIES), steps=1)
    twin = meta_twin(module)
    assert all(p.is_meta for p in twin.parameters())
    assert [p.shape for p in twin.parameters()] == [p.shape for p in module.parameters()]


def test_modules_whose_hash_follows_their_state_get_no_copier():
    """A copier's weak reference to a torchmetrics metric (hashed by its state) caches the metric's first hash, and
    ``ModuleTracker``'s lookups missed it after the next update (``KeyError`` in the examples' steps, as once for
    ``full_state_dict``'s hooks). Modules with nothing sharded below get no copier; a plain deep copy suits them.
    Mutation tried: a copier on every module (the tracker raised)."""
    from torch.utils.module_tracker import ModuleTracker
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_vitscale.sharding import plain_copy

    model = nn.Module()
    model.linear, model.accuracy = nn.Linear(4, 3), MulticlassAccuracy(num_classes=3)
    plain_copy.install(plain_copy.record_forwards(model), model)
    assert "__deepcopy__" in vars(model.linear) and "__deepcopy__" not in vars(model.accuracy)
    target = torch.tensor([0, 2])
    for _ in range(2):  # the first pass hashes the metric, the update changes its hash, the second looks it up
        with ModuleTracker():
            model.accuracy(model.linear(torch.randn(2, 4)).argmax(-1), target)
    assert model.accuracy.update_count == 2


@LAYOUTS
def test_torch_save_of_the_model_holds_the_plain_module(layout, tmp_path):
    """``torch.save(model, path)`` after fit (pickle) writes DDP's plain module: it loads in a process without the
    strategy (``weights_only=False``, the user's opt-in for a pickled module) with the model's state and forward;
    the model stays sharded. Before, pickle refused FSDP2's unit class. Mutation tried: no instance
    ``__reduce_ex__`` (the PicklingError again)."""
    module = without_dropout(Classifier())
    fit(module, VitScaleStrategy(**layout), steps=2)
    torch.save(module, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is Classifier and strategy_leftovers(loaded) == []
    state = module.state_dict()
    assert all(torch.equal(loaded.state_dict()[key], value) for key, value in state.items())
    plain = Classifier()
    plain.load_state_dict(state)
    assert torch.equal(output(loaded), output(plain))
    assert all(isinstance(p, DTensor) for p in module.parameters())


def test_tracing_or_exporting_the_sharded_model_names_the_plain_copy_which_traces():
    """``torch.jit.trace`` (Lightning's ``to_torchscript``, ONNX's old exporter) and ``torch.export`` would record
    the shards and the strategy's gathers: refused at the first call, naming the fix, which works. Before, torch
    failed deep inside ("Cannot insert a Tensor that requires grad as a constant"; a DTensor in export). Mutation
    tried: the check removed (torch's own errors again)."""
    module = without_dropout(Classifier())
    fit(module, VitScaleStrategy(**COPIES), steps=1)
    module.eval()
    with pytest.raises(RuntimeError, match=r"copy\.deepcopy\(model\)\.eval\(\)"):
        torch.jit.trace(module.backbone, PROBE)
    with pytest.raises(RuntimeError, match=r"copy\.deepcopy\(model\)\.eval\(\)"):
        torch.export.export(module, (PROBE,))
    plain = copy.deepcopy(module.backbone).eval()  # as under DDP: a LightningModule itself traces by to_torchscript
    traced = torch.jit.trace(plain, PROBE, check_trace=False)  # nn.TransformerEncoder's eval fast path varies
    with torch.no_grad():  # traced with autograd on: not the encoder's fused eval path, so not bit-equal
        torch.testing.assert_close(traced(PROBE), output(plain))
        torch.testing.assert_close(torch.export.export(plain, (PROBE,)).module()(PROBE), output(plain))
