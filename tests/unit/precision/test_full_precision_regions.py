"""A step's own fp32 region (``torch.autocast(..., enabled=False)``) computes in fp32 under O2, as under DDP's AMP, on
one device; the 2-rank run is in tests/distributed/test_precision.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScalePrecision, VitScaleStrategy
from lightning_vitscale._compat import autocast_turned_off
from lightning_vitscale.discovery.calls import Calls, recording
from tests.helpers.models import Streamed


def test_autocast_turned_off_is_true_only_inside_a_region_that_turns_it_off():
    assert not autocast_turned_off("cpu")  # no region: O2's step runs without autocast
    with torch.autocast("cpu", enabled=False):
        assert autocast_turned_off("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not autocast_turned_off("cpu")
        assert autocast_turned_off("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not autocast_turned_off("cpu")
    assert not autocast_turned_off("cpu")


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(L.LightningModule):
    """Three blocks and a head; ``fp32_head``: the head computed inside ``torch.autocast(enabled=False)``."""

    def __init__(self, fp32_head: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.head = nn.Linear(16, 4)
        self.fp32_head, self.dtypes = fp32_head, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        features = self.blocks(x).mean(1)
        if self.fp32_head:
            with torch.autocast(features.device.type, enabled=False):
                logits = self.head(features.float())
        else:
            logits = self.head(features)
        self.dtypes.append(logits.dtype)
        return F.cross_entropy(logits.float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: L.LightningModule, strategy: VitScaleStrategy, streamed: bool = False,
        plugin: VitScalePrecision | None = None) -> VitScaleStrategy:
    """Three steps under ``bf16-mixed``; ``streamed``: from batches setup cannot read ahead (no step at setup)."""
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(12, 5, 16, generator=g), torch.randint(0, 4, (12,), generator=g)),
                      batch_size=4)
    precision = {"plugins": [plugin]} if plugin is not None else {"precision": "bf16-mixed"}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **precision)
    trainer.fit(model, Streamed(data) if streamed else data)
    return strategy


@pytest.mark.parametrize("priority", ["speed", "memory"])
def test_a_head_the_step_computes_in_fp32_computes_in_fp32(priority):
    """On one device: compute copies (``"speed"``) and FSDP2's units (``"memory"``). Before, the head's weight was
    bf16 and the outer unit cast its fp32 input back to bf16: bf16 logits, the user's region silently ignored."""
    model = Net(fp32_head=True)
    strategy = fit(model, VitScaleStrategy(priority=priority))
    assert model.dtypes == [torch.float32] * 3
    assert model.head.weight.dtype == torch.float32
    note = next(n for n in strategy.plan.notes if "kept in fp32" in n)
    assert note.endswith(": head") and "1 module(s)" in note and "head" in strategy.plan.fp32_modules


def test_a_parametrized_head_the_step_computes_in_fp32_is_kept_and_named():
    """A weight-normalized head without a bias (``parametrizations.weight_norm``: its parameters live in a child,
    ``head.parametrizations.weight``) run in the step's own fp32 region: kept in fp32 through that child, and the
    note names the head the step ran. Before, the note matched the kept modules' own names only and said nothing.
    Mutation seen failing: the note's match by name alone."""
    model = Net(fp32_head=True)
    model.head = nn.utils.parametrizations.weight_norm(nn.Linear(16, 4, bias=False))  # no parameter of its own
    strategy = fit(model, VitScaleStrategy())
    assert model.dtypes == [torch.float32] * 3
    assert "head.parametrizations.weight" in strategy.plan.fp32_modules and "head" not in strategy.plan.fp32_modules
    note = next(n for n in strategy.plan.notes if "kept in fp32" in n)
    assert note.endswith(": head") and "1 module(s)" in note


def test_checkpointing_s_recompute_is_no_fp32_region_of_the_step():
    """``torch.utils.checkpoint`` recomputes a block inside an autocast region of its own that restores the forward's
    state (autocast off under O2): without the backward check the planner's checkpointed measurement made the
    recomputed blocks' layers fp32 modules. Mutation seen failing: the ``current_backward_id`` check dropped."""
    model = Net(fp32_head=False)
    strategy = fit(model, VitScaleStrategy(priority="memory"))  # every block checkpointed
    assert model.dtypes == [torch.bfloat16] * 3
    assert not any("kept in fp32" in n for n in strategy.plan.notes)
    assert strategy.plan.fp32_modules == ["blocks.0.norm", "blocks.1.norm", "blocks.2.norm"]
    calls, block = Calls(), Block()
    with recording(block, calls):
        torch.utils.checkpoint.checkpoint(block, torch.randn(2, 16, requires_grad=True), use_reentrant=False).sum(
        ).backward()
    assert calls.counts["fc"] == 2 and not calls.full_precision  # ran in forward and in the recompute


def test_without_a_step_at_setup_the_region_is_warned_once_naming_the_option_that_keeps_it_fp32():
    """Setup cannot read a batch from a stream: no step, so no region found; the head computes in bf16 and the
    warning names it and ``full_precision=``, which then keeps it fp32 (a block named keeps its layers)."""
    model = Net(fp32_head=True)
    with pytest.warns(UserWarning, match=r"runs `head` inside its own `torch.autocast") as caught:
        fit(model, VitScaleStrategy(), streamed=True)
    assert model.dtypes == [torch.bfloat16] * 3
    warned = [w for w in caught if "inside its own" in str(w.message)]
    assert len(warned) == 1 and 'full_precision={"head"}' in str(warned[0].message)
    fixed = Net(fp32_head=True)
    plugin = VitScalePrecision("bf16-mixed", full_precision={"head", "blocks.2"})
    strategy = fit(fixed, VitScaleStrategy(), streamed=True, plugin=plugin)
    assert fixed.dtypes == [torch.float32] * 3
    kept = set(strategy.plan.fp32_modules)
    assert {"head", "blocks.2.fc"} <= kept and "blocks.1.fc" not in kept


class NoisyNet(Net):
    """A tensor made in fp32 inside the step (no region): the outer unit casts it to bf16, as autocast would."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.blocks(x).mean(1).float() + torch.randn(x.shape[0], 16))
        self.dtypes.append(logits.dtype)
        return F.cross_entropy(logits.float(), y)


def test_an_fp32_tensor_outside_any_region_is_cast_without_a_warning(recwarn):
    """Mutation seen failing: the warning's ``autocast_turned_off`` check dropped."""
    model = NoisyNet(fp32_head=False)
    fit(model, VitScaleStrategy(), streamed=True)
    assert model.dtypes == [torch.bfloat16] * 3
    assert not [w for w in recwarn if "inside its own" in str(w.message)]


@pytest.mark.parametrize("asked", [dict(precision="bf16-true"), dict(precision="32-true"),
                                   dict(precision="bf16-mixed", norm_dtype=None)])
def test_full_precision_where_it_cannot_apply_is_refused_naming_why(asked):
    """Never a flag silently ignored: bf16 master weights (DDP's are bf16 too there), fp32 already, or norms told to
    follow the model."""
    with pytest.raises(ValueError, match=r"`full_precision=\{'head'\}` keeps modules in fp32 under the mixed flags"):
        VitScalePrecision(**asked, full_precision={"head"})


def test_full_precision_applies_with_norms_off_too():
    """``norms=False`` (no norm special): the named module is still kept, alone. Before the check, it was dropped
    without a word (no norm predicate to extend)."""
    policy = VitScalePrecision("bf16-mixed", norms=False, full_precision={"head"}).policy
    assert [name for name, _ in policy.separate_norm_modules(Net(fp32_head=True))] == ["head"]


class HeadInFp32(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(x).mean(1)
        with torch.autocast(features.device.type, enabled=False):
            return self.head(features.float())


def test_the_planner_counts_a_module_of_the_step_s_fp32_region_with_the_norms():
    """The planner measured the step before it knew the region: the head counted as a bf16 sharded layer where setup
    then keeps it replicated in fp32. Measured again with it kept, as the norms are. Mutation seen failing: no second
    measurement for the region."""
    from lightning_vitscale.memory.planner import step_inputs

    calls = Calls()
    inputs = step_inputs(HeadInFp32(), torch.randn(4, 5, 16), precision="bf16-mixed", world_size=2, calls=calls)
    assert calls.full_precision == {"head"}
    assert sorted(inputs.layout.norms) == sorted([(16,)] * 6 + [(4, 16), (4,)])  # 3 LayerNorms' weight, bias; head
    assert (4, 16) not in inputs.layout.outer
