"""One rank: each param group of an elementwise optimizer steps as one flat tensor (``precision/flat_step.py``),
bit for bit the per-tensor step, through ``Trainer.fit``; what does not match the layout steps per tensor."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale._compat import dtensor_like
from lightning_vitscale.precision import flat_step
from tests.helpers.models import Classifier, loader
from tests.helpers.state import snapshot

Make = Callable[[list[dict]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-3),
    "AdamW fused": lambda groups: torch.optim.AdamW(groups, lr=1e-3, fused=True),  # a GPU's default: counters on
    # the parameters' device
    "SGD momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "SGD": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),  # state made in its constructor
    "NAdam": lambda groups: torch.optim.NAdam(groups, lr=1e-3),  # a second counter, `mu_product`
}


class Grouped(Classifier):
    """timm's weight-decay split: matrices decay, biases and norms not; the two groups interleave in the model."""

    def __init__(self, optimizer: str = "AdamW") -> None:
        super().__init__("encoder")
        self.optimizer = optimizer

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim > 1]
        rest = [p for p in self.parameters() if p.ndim <= 1]
        return OPTIMIZERS[self.optimizer]([{"params": decay, "weight_decay": 0.05}, {"params": rest}])


class AtEnd(Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = snapshot(pl_module, trainer)


def fit(make: Callable[[], L.LightningModule], steps: int = 5, ckpt_path=None, callbacks=(), accelerator: str = "cpu",
        **trainer) -> tuple[L.LightningModule, L.Trainer, dict]:
    L.seed_everything(0, verbose=False)
    module = make()
    at_end = AtEnd()
    run = L.Trainer(accelerator=accelerator, devices=1, strategy=VitScaleStrategy(activation_checkpointing=False),
                    precision="bf16-mixed", max_steps=steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0, callbacks=[at_end, *callbacks], **trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(module, loader(12, batch_size=4), ckpt_path=ckpt_path)  # 3 steps an epoch
    return module, run, at_end.state


@pytest.fixture
def per_tensor(monkeypatch):
    """Runs made with this step per tensor, as before flat groups existed."""
    def per_tensor_only() -> None:
        monkeypatch.setattr(flat_step, "lay_out", lambda optimizers, eligible: [])
    return per_tensor_only


@pytest.fixture
def flat_steps(monkeypatch) -> list[int]:
    """How many groups stepped flat, step by step."""
    counts: list[int] = []
    enter = flat_step.enter

    def counting(optimizer):
        entered = enter(optimizer)
        counts.append(len(entered))
        return entered

    monkeypatch.setattr(flat_step, "enter", counting)
    return counts


def state_is_flat(run: L.Trainer) -> bool:
    """Every elementwise state tensor a view of its group's flat buffer (one buffer per group and key)."""
    optimizer = run.optimizers[0]
    for group in optimizer.param_groups:
        bases: dict[str, set[int]] = {}
        for param in group["params"]:
            for key, value in optimizer.state[param].items():
                if isinstance(value, DTensor):
                    base = value._local_tensor._base
                    bases.setdefault(key, set()).add(-1 if base is None else id(base))
        if any(len(ids) != 1 or -1 in ids for ids in bases.values()):
            return False
    return True


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, different


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_param_groups_step_flat_bit_for_bit_as_per_tensor(optimizer, per_tensor, flat_steps, monkeypatch):
    copied_in: list[int] = []
    copy_in = flat_step.FlatGroup._copy_in
    monkeypatch.setattr(flat_step.FlatGroup, "_copy_in", lambda *args: copied_in.append(1) or copy_in(*args))
    module, run, flat = fit(lambda: Grouped(optimizer))
    assert flat_steps == [2] * 5  # both groups, every step
    assert len(copied_in) == (2 if optimizer == "Adagrad" else 0)  # its constructor's state, once per group
    assert any("stepped as one flat tensor" in note for note in run.strategy.plan.notes)
    if optimizer != "SGD":  # SGD keeps no state
        assert state_is_flat(run)
    per_tensor()
    reference, _, expected = fit(lambda: Grouped(optimizer))
    assert module.losses == reference.losses
    assert_equal(flat, expected)


def test_accumulated_gradients_step_flat_as_per_tensor(per_tensor, flat_steps):
    module, _, flat = fit(Grouped, accumulate_grad_batches=2)
    assert flat_steps == [2] * 5
    per_tensor()
    reference, _, expected = fit(Grouped, accumulate_grad_batches=2)
    assert module.losses == reference.losses
    assert_equal(flat, expected)


@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_a_resumed_run_steps_flat_again_as_a_resumed_per_tensor_run(tmp_path, layout, per_tensor, flat_steps):
    _, first, _ = fit(Grouped, steps=3)
    first.strategy.state_dict_type = layout
    first.save_checkpoint(tmp_path / "saved.ckpt")
    flat_steps.clear()
    module, resumed, state = fit(Grouped, steps=6, ckpt_path=tmp_path / "saved.ckpt")
    assert flat_steps == [2] * 3  # the loaded per-parameter state copied into flat buffers at the first step
    assert state_is_flat(resumed)
    per_tensor()
    reference, _, expected = fit(Grouped, steps=6, ckpt_path=tmp_path / "saved.ckpt")
    assert module.losses == reference.losses
    assert_equal(state, expected)


class UnusedParameter(Grouped):
    """A trainable parameter the step never uses (a mask token): it has no gradient, so its group steps per tensor
    and the parameter keeps no state, as under DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.mask_token = torch.nn.Parameter(torch.zeros(1, 8))


class ReplacedGradient(Callback):
    """A callback swapping in a gradient of its own before the third step: the flat buffer no longer holds it, that
    group steps per tensor once, then flat again from the state that step left."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 2:
            weight = pl_module.backbone.head.weight
            weight.grad = weight.grad * 2.0


class ReplacedCounter(Callback):
    """A callback replacing one parameter's step counter mid-run: counters that disagree have no flat form."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            optimizer = trainer.optimizers[0]
            optimizer.state[pl_module.backbone.head.weight]["step"] = torch.tensor(10.0)


class RawStep(Grouped):
    """Manual optimization that once steps the torch optimizer itself, bypassing Lightning's step, on all parameters
    but one (legal under DDP): the counters then disagree, and the flat step must notice."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.manual_backward(loss)
        if batch_idx == 1:
            self.backbone.head.weight.grad = None
            optimizer.optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(("make", "callbacks", "expected_flat"), [
    (UnusedParameter, (), [1] * 5),  # the decay group lacks the mask token's gradient; the other group is flat
    (Grouped, (ReplacedGradient(),), [2, 2, 1, 2, 2]),
    (Grouped, (ReplacedCounter(),), [2, 2, 1, 1, 1]),
    (RawStep, (), [2, 1, 1, 1, 1]),  # the raw step (one more batch) enters nothing; then the decay group disagrees
], ids=["no gradient", "replaced gradient", "disagreeing counters", "raw optimizer step"])
def test_what_does_not_match_the_layout_steps_per_tensor_as_before(make, callbacks, expected_flat, per_tensor,
                                                                    flat_steps):
    module, _, flat = fit(make, callbacks=callbacks)
    if make is UnusedParameter:
        assert "o.mask_token.exp_avg" not in flat  # no state made for it, as under DDP
    assert flat_steps == expected_flat
    per_tensor()
    reference, _, expected = fit(make, callbacks=callbacks)
    assert module.losses == reference.losses
    assert_equal(flat, expected)


def test_the_state_dict_gives_tensors_of_their_own_not_views_of_the_flat_masters():
    module, _, _ = fit(Grouped, steps=1)
    state = module.state_dict()
    storages = [value.untyped_storage().data_ptr() for value in state.values()]
    assert len(set(storages)) == len(storages)  # safetensors refuses tensors that share storage
    live = {p._local_tensor.untyped_storage().data_ptr() for p in module.parameters()}
    assert not live & set(storages)  # nor the live parameters' (as every rank's on N ranks)


def test_the_masters_moved_into_flat_buffers_leave_no_second_copy(monkeypatch):
    """The layout copies each group's masters into one buffer: the tensors they had must be freed, or a one-GPU
    run would hold the model's fp32 weights twice."""
    before: list[weakref.ref] = []
    lay_out = flat_step.lay_out

    def recording(optimizers, eligible):
        before.extend(weakref.ref(p._local_tensor) for p in eligible)
        return lay_out(optimizers, eligible)

    monkeypatch.setattr(flat_step, "lay_out", recording)
    module, _, _ = fit(Grouped, steps=2)
    gc.collect()
    assert before and not [ref for ref in before if ref() is not None]
    assert all(p._local_tensor._base is not None for p in module.parameters())  # they live in the flat buffers


def test_a_group_that_fails_to_enter_leaves_the_groups_entered_before_it_as_they_were(monkeypatch):
    module, run, _ = fit(Grouped, steps=2)
    optimizer = run.optimizers[0]
    first, second = flat_step._LAYOUTS[optimizer]
    for flat in (first, second):  # gradients laid out as the hand-over lays them out
        for param, view in zip(flat.params, flat.gradient_views()):
            param.grad = dtensor_like(view.normal_(), param)
    assert first.enter(first.params, optimizer.state)  # it can step flat
    first.leave(optimizer.state, stepped=False)

    def failing(state):
        raise RuntimeError("boom")

    monkeypatch.setattr(second, "_state_ready", failing)
    with pytest.raises(RuntimeError, match="boom"):
        flat_step.enter(optimizer)
    assert first.masters.grad is None and first.masters not in optimizer.state
