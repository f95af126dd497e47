"""Copies the strategy runs by itself (the planner's twin, the tensor plan's proof) run a user's hooks on the copy.

Feature hooks closing over the model (``layer.register_forward_hook(lambda m, i, out: self.seen.update(f0=out))``,
read back by the model's forward: multi-scale features, a probe on an intermediate layer) wrote into the original
module from the planner's copy, whose forward read its own, empty dict: ``KeyError`` on fake tensors and on real
values, and the default fell back to every block checkpointed (a third more compute), fake tensors left in the user's
module."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale._utils import private_copy
from lightning_vitscale.memory.twin import meta_twin
from lightning_vitscale.sharding.tensor_proof import _copy as proof_copy
from tests.helpers.zoo import CLASSES, IMAGE, timm_vit

SHARED: dict[str, torch.Tensor] = {}  # a dict outside the model: the copy's hook and forward share it, as before


def _decorated(hook):
    @functools.wraps(hook)
    def wrapper(*args):
        return hook(*args)

    return wrapper


class Features(nn.Module):
    """A ViT read at its first block and its last norm through forward hooks, each kind of hook a user writes."""

    def __init__(self, kind: str = "closure") -> None:
        super().__init__()
        self.vit, self.seen = timm_vit(), {}
        self.head = nn.Linear(2 * self.vit.embed_dim, CLASSES)
        store = {"closure": lambda name: lambda module, args, out: self.seen.__setitem__(name, out),
                 "decorated": lambda name: _decorated(lambda module, args, out: self.seen.__setitem__(name, out)),
                 "partial": lambda name: functools.partial(self.keep, name),
                 "outside": lambda name: lambda module, args, out: SHARED.__setitem__(name, out)}[kind]
        self.vit.blocks[0].register_forward_hook(store("first"))
        self.vit.norm.register_forward_hook(store("last"))
        self.kind = kind

    def keep(self, name: str, module: nn.Module, args, out: torch.Tensor) -> None:
        self.seen[name] = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.vit.forward_features(x)
        seen = SHARED if self.kind == "outside" else self.seen
        return self.head(torch.cat([seen["first"][:, 0], seen["last"][:, 0]], -1))


@pytest.mark.parametrize("kind", ["closure", "decorated", "partial", "outside"])
def test_the_planners_twin_runs_hooks_on_itself_and_leaves_the_model_alone(kind):
    """Mutation seen failing: ``meta_twin`` by plain ``copy.deepcopy`` (closure and decorated: KeyError)."""
    torch.manual_seed(0)
    model = Features(kind)
    twin = meta_twin(model)
    out = twin(torch.empty(2, 3, IMAGE, IMAGE, device="meta"))
    assert out.is_meta and out.shape == (2, CLASSES)
    assert model.seen == {}  # nothing of the copy's run in the user's module
    if kind != "outside":
        assert set(twin.seen) == {"first", "last"} and all(t.is_meta for t in twin.seen.values())


def test_a_rebound_hook_keeps_its_name_defaults_and_what_it_holds_that_was_not_copied():
    marker = object()

    def hook(module, args, out, scale=2.0, *, extra=marker):
        holder.seen["out"] = out * scale
        return None

    holder = nn.Linear(2, 2)
    holder.seen = {}
    holder.register_forward_hook(hook)
    twin = private_copy(holder, {})
    (copied,) = twin._forward_hooks.values()
    assert copied is not hook and copied.__qualname__ == hook.__qualname__
    assert copied.__defaults__ == (2.0,) and copied.__kwdefaults__ == {"extra": marker}  # not copied: not in the memo
    twin(torch.ones(1, 2))
    assert "out" in twin.seen and holder.seen == {}


def test_the_tensor_plans_proof_runs_a_blocks_own_hooks_on_its_copy():
    """A block that reads what a hook on one of its layers kept (the proof runs a copy of each block). Mutation seen
    failing: the proof's copy by plain ``copy.deepcopy`` (KeyError)."""

    class Probed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.kept = nn.Linear(8, 8), nn.Linear(8, 8), {}
            self.fc1.register_forward_hook(lambda module, args, out: self.kept.__setitem__("fc1", out))

        def forward(self, x):
            self.fc1(x)
            return self.fc2(x) + self.kept.pop("fc1")

    block = Probed()
    copy = proof_copy(block, torch.device("cpu"), real_values=True)
    assert copy(torch.randn(2, 8)).shape == (2, 8) and block.kept == {}


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone, self.losses = Features(), []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(strategy) -> tuple[list[float], L.Trainer]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(12, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (12,), generator=g))
    model = Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model.losses, trainer


def test_a_model_reading_its_own_feature_hooks_is_planned_from_its_step_and_trains_as_ddp():
    """The default planned from the measured step (nothing checkpointed: the activations fit), DDP's losses bit for
    bit. Mutation seen failing: ``meta_twin`` by plain ``copy.deepcopy`` (``could not run ... KeyError: 'first'``,
    every block checkpointed)."""
    ours, trainer = _fit(VitScaleStrategy())
    summary = trainer.strategy.plan.summary()
    assert "through training_step" in summary and "could not run" not in summary, summary
    assert "checkpointed blocks : 0 of 2" in summary, summary
    assert ours == _fit("ddp_find_unused_parameters_true")[0]  # timm's own head is not used
