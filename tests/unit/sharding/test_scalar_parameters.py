"""0-dim parameters (CLIP's ``logit_scale``), which FSDP2 refuses ("fully_shard doesn't support scalar parameters"),
train as under DDP on one device (2 ranks against DDP: ``tests/distributed/test_scalar_parameters.py``):
held replicated with the norms, shown as a plain tensor inside computations and as the parameter outside them.
Before 2026-12-05 setup refused them, naming a one-line reshape to (1,).

Mutations seen failing: the owner's ``__getattr__`` returning the parameter during computations (the forward mixes a
DTensor with tensors: torch's "mixed torch.Tensor and DTensor"); the backward check dropped (checkpointing's
recompute of a gated block inside backward: the same error, under ``priority="memory"`` only); the leaf returned
outside computations too (``configure_optimizers`` collects leaves: the optimizer steps nothing, the test of what is
shown fails); the values not prepared (rank 0's not broadcast: the 2-rank test's losses differ); the deep copy
keeping the owner class.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.checkpoint.safe_reading import load_pickle
from tests.helpers.contrastive import FLOOR, PairEncoder, TemperatureClip, fit, scalars

PLANS = {"default": {}, "memory": {"priority": "memory"}}


@pytest.fixture(scope="module")
def plain() -> TemperatureClip:
    return fit("ddp")  # DDP on one device: the same distributed sampler


@pytest.mark.parametrize("plan", PLANS)
def test_0_dim_parameters_train_as_under_ddp(plain, plan):
    """The model's temperature (its forward), the LightningModule's margin (``training_step``) and each block's gate
    (the block's forward, recomputed inside backward under ``priority="memory"``): DDP's losses and
    values bit for bit, open_clip's in-place clamp in ``on_train_batch_end`` applied."""
    strategy = VitScaleStrategy(**PLANS[plan])
    ours = fit(strategy)
    assert len(plain.losses) == 4 and ours.losses == plain.losses
    assert scalars(ours) == scalars(plain)
    assert ours.temperatures == plain.temperatures and ours.temperatures[2:] == [FLOOR, FLOOR]  # the clamp acted
    summary = strategy.plan.summary()
    assert "6 0-dim or complex parameter(s) (margin, net.logit_scale, net.image.blocks.0.gate, ... +3)" in summary
    if plan == "memory":
        assert "checkpointed blocks : 4 of 4" in summary


class Recording(TemperatureClip):
    """What the attribute shows where user code reads it."""

    def configure_optimizers(self):
        self.collected = [type(self.net.logit_scale), type(self.margin)]
        return torch.optim.AdamW([self.net.logit_scale, self.margin, *self.net.image.parameters(),
                                  *self.net.text.parameters()], lr=0.5)

    def training_step(self, batch, batch_idx):
        self.in_step = [type(self.net.logit_scale), type(self.margin), self.margin.requires_grad]
        return super().training_step(batch, batch_idx)


def test_the_parameter_outside_computations_and_a_plain_tensor_inside():
    """``configure_optimizers`` collects the replicated parameters (a list built from the attributes, not
    ``self.parameters()``: the optimizer steps them); ``training_step`` computes on plain tensors."""
    model = Recording()
    L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(), max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
    assert all(issubclass(kind, DTensor) for kind in model.collected)
    assert not any(issubclass(kind, DTensor) for kind in model.in_step[:2]) and model.in_step[2]
    assert scalars(model)["margin"] != 0.1  # stepped by the optimizer that holds it


def test_a_deep_copy_and_a_full_checkpoint_hold_the_plain_0_dim_parameters(tmp_path):
    """After ``fit``: ``copy.deepcopy`` gives DDP's module (its own class, plain 0-dim parameters), and a full
    checkpoint holds shape ``()``, loading strictly into the plain model."""
    strategy = VitScaleStrategy(state_dict_type="full")
    model = fit(strategy)
    net = copy.deepcopy(model.net)
    assert type(net) is PairEncoder and type(net.logit_scale) is nn.Parameter and net.logit_scale.shape == ()
    assert float(net.logit_scale) == scalars(model)["net.logit_scale"]
    path = tmp_path / "full.ckpt"
    strategy.lightning_module.trainer.save_checkpoint(path)
    state = load_pickle(path, weights_only=True)["state_dict"]
    assert state["net.logit_scale"].shape == () and state["net.image.blocks.1.gate"].shape == ()
    fresh = TemperatureClip()
    fresh.load_state_dict(state, strict=True)
    assert {name: float(p) for name, p in fresh.named_parameters() if p.dim() == 0} == scalars(model)


def test_torch_save_of_a_module_holding_0_dim_parameters_holds_the_plain_module(tmp_path):
    """``torch.save(model)`` (pickle) of the LightningModule, an owner whose class the strategy extended: DDP's plain
    module, naming nothing of this package. Before: pickle refused ("args[0] from __newobj__ args has the wrong
    class"): the plain copy's ``copyreg.__newobj__`` of the plain class for an object of another. Mutation seen
    failing: ``plain_copy``'s ``copyreg._reconstructor`` fallback removed."""
    model = fit(VitScaleStrategy(), steps=2)
    torch.save(model, tmp_path / "model.pt")
    assert b"lightning_vitscale" not in (tmp_path / "model.pt").read_bytes()
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)  # the user's opt-in for a pickled module
    assert type(loaded) is TemperatureClip and type(loaded.margin) is nn.Parameter
    assert {name: float(p) for name, p in loaded.named_parameters() if p.dim() == 0} == scalars(model)


def test_hugging_face_clip_trains_unchanged():
    """HF's ``CLIPModel`` (0-dim ``logit_scale``) as it is: DDP's losses."""
    transformers = pytest.importorskip("transformers")

    class Clip(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=100, max_position_embeddings=16)
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          image_size=32, patch_size=8)
            config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
            self.net = transformers.CLIPModel(config)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            images, ids = batch
            loss = self.net(input_ids=ids, pixel_values=images, return_loss=True).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(12, 3, 32, 32, generator=generator),
                                          torch.randint(2, 100, (12, 8), generator=generator))
    losses = []
    for strategy in ("ddp", VitScaleStrategy()):
        model = Clip()
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  ).fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        losses.append(model.losses)
    assert len(losses[0]) == 3 and losses[1] == losses[0]


def test_a_shared_owner_is_found_once_and_a_tied_parameter_replicated_once(mesh):
    """A block held twice is one owner; a 0-dim parameter two modules hold is one replicated parameter in both slots
    (its gradient, from both uses, reaches one parameter). Mutation seen failing: ``named_modules(remove_duplicate=
    False)`` (the shared block found twice)."""
    from lightning_vitscale.precision import ReplicatedNorms
    from lightning_vitscale.sharding.scalar_parameters import find_unshardable_parameters, replicate_unshardable
    from tests.helpers.contrastive import GatedBlock

    shared, first, second = GatedBlock(), GatedBlock(), GatedBlock()
    second.gate = first.gate
    model = nn.ModuleDict({"a": shared, "b": shared, "first": first, "second": second})
    found = find_unshardable_parameters(model)
    assert [name for name, _, _ in found] == ["a.gate", "first.gate", "second.gate"]
    replicas = ReplicatedNorms([], mesh)
    replicate_unshardable(model, found, replicas)
    assert first.gate is second.gate and isinstance(first.gate, DTensor) and len(replicas.params) == 2


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_complex_parameters_train_as_under_ddp_on_one_device(precision):
    """A Fourier neural operator's ``torch.cfloat`` weights (``tests/helpers/zoo.py``: ``FourierOperator``), which
    FSDP2 refused at setup ("FSDP expects uniform original parameter dtype"), are held as 0-dim ones are, with
    gradient clipping on: DDP's losses (fp32 bit for bit; DDP's AMP within 1e-4). 2 ranks, checkpoint resume too:
    ``tests/distributed/test_zoo.py``."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.helpers.zoo import CLASSES, IMAGE, FourierOperator

    class Operator(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net, self.losses = FourierOperator(), []

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(12, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (12,), generator=g))
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("ours", VitScaleStrategy())):
        model = Operator()
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=3, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  gradient_clip_val=0.5).fit(model, DataLoader(data, batch_size=4))
        runs[name] = model.losses
    assert len(runs["ddp"]) == 3
    tolerance = 0 if precision == "32-true" else 1e-4
    assert max(abs(a - b) / abs(b) for a, b in zip(runs["ours"], runs["ddp"])) <= tolerance
