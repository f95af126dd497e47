"""What the planner measures per block, and how often: blocks that run different code are measured apart, equal
ones once, and a block whose checkpointing is settled only for that checkpointing (a third of the setup work)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory import activations
from lightning_vitscale.memory.activations import measure_activations
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_model import StepSettings, predict_step

DIM, TOKENS, BATCH = 16, 32, 2


class Attending(nn.Module):
    """ViTDet's pattern: one class, the same parameters, attention within windows (``window`` > 0) or global."""

    def __init__(self, window: int, drop: float = 0.0) -> None:
        super().__init__()
        self.window, self.drop = window, drop
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        groups = x.reshape(b * n // self.window, self.window, d) if self.window else x
        mixed = (groups @ groups.transpose(-1, -2)).softmax(-1) @ groups
        out = self.proj(mixed.reshape(b, n, d))
        return nn.functional.dropout(out, self.drop) if self.drop else out


def profile(blocks: list[nn.Module], **kwargs):
    model = nn.Sequential(*blocks)
    return measure_activations(model, [(str(i), b) for i, b in enumerate(blocks)], torch.empty(BATCH, TOKENS, DIM),
                               **kwargs)


def attention_flops(group: int) -> int:
    return 2 * 2 * BATCH * TOKENS * group * DIM  # two matmuls of (tokens x group) by (group x dim) per window


def count_passes(monkeypatch) -> list[None]:
    """Counts block passes from an empty process cache of them."""
    calls: list[None] = []
    monkeypatch.setattr(activations, "_PASSES", {})
    real = activations._peak_beyond_forward

    def counted(*args, **kwargs):
        calls.append(None)
        return real(*args, **kwargs)

    monkeypatch.setattr(activations, "_peak_beyond_forward", counted)
    return calls


def test_blocks_that_differ_only_in_a_setting_are_measured_apart():
    """Windowed and global attention share class and parameters; their recompute work differs by the attention."""
    windowed, global_ = profile([Attending(window=4), Attending(window=0)]).blocks
    linear = 2 * BATCH * TOKENS * DIM * DIM
    assert windowed.work.flops == attention_flops(4) + linear
    assert global_.work.flops == attention_flops(TOKENS) + linear


def test_equal_blocks_are_measured_once_whatever_their_nonzero_rates(monkeypatch):
    """Drop rates growing block by block (stochastic depth) do not make each block its own measurement; a zero
    rate, which skips the op, does."""
    calls = count_passes(monkeypatch)
    profile([Attending(4, drop=0.1), Attending(4, drop=0.2), Attending(4, drop=0.3)])
    assert len(calls) == 3  # none, full, selective: once for the three
    calls.clear()
    profile([Attending(4, drop=0.1), Attending(4, drop=0.0)])
    assert len(calls) == 3  # the zero rate's block: the other one is known from the first measurement


def test_a_later_measurement_of_the_same_architecture_runs_no_block_pass_and_gives_the_same_profile(monkeypatch):
    """The process keeps what each block pass measured (a second fit, a sweep); what differs in the ops it runs is
    measured anew: another input size, a class whose forward was patched, an activation's bound argument, a
    tensor-parallel split."""
    calls = count_passes(monkeypatch)
    first = profile([Attending(4), Attending(4)])
    assert len(calls) == 3
    calls.clear()
    assert profile([Attending(4), Attending(4)]) == first and not calls
    monkeypatch.setattr(activations, "_PASSES", {})
    assert profile([Attending(4), Attending(4)]) == first and len(calls) == 3  # the cache changes no number
    calls.clear()
    block = Attending(4)
    measure_activations(nn.Sequential(block), [("0", block)], torch.empty(BATCH, 2 * TOKENS, DIM))
    assert len(calls) == 3  # another input shape
    calls.clear()
    real = Attending.forward
    monkeypatch.setattr(Attending, "forward", lambda self, x: real(self, x) * 2)
    profile([Attending(4)])
    assert len(calls) == 3
    calls.clear()
    gelu = [nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)]
    for block, approximate in zip(gelu, ("none", "tanh")):
        block.act = functools.partial(nn.functional.gelu, approximate=approximate)
    profile(gelu)
    assert len(calls) == 6  # the two bound approximations are two blocks


@pytest.mark.parametrize("settled", ["full", "selective", None])
def test_a_settled_checkpointing_is_measured_alone_and_predicts_as_the_full_measurement(monkeypatch, settled):
    with torch.device("meta"):
        model = TinyViT(image=32, patch=4, dim=32, depth=3)
    example = torch.empty(4, 3, 32, 32, device="meta")
    everything = step_inputs(model, example, precision="32-true")
    calls = count_passes(monkeypatch)
    settled_only = step_inputs(model, example, precision="32-true", mode_of=lambda *_: settled)
    assert len(calls) == 1  # one pass for the three equal blocks, not three
    n = len(everything.profile.blocks)
    checkpointed = frozenset(range(n)) if settled else frozenset()
    selective = checkpointed if settled == "selective" else frozenset()
    settings = StepSettings(checkpointed, selective=selective)
    assert predict_step(settled_only, settings) == predict_step(everything, settings)
    other = StepSettings() if settled else StepSettings(frozenset(range(n)))
    with pytest.raises(ValueError, match="was measured for .* only"):
        predict_step(settled_only, other)


def test_a_measurement_asks_once_whether_a_gpu_may_be_initialised(monkeypatch):
    """FakeTensorMode asks ``torch.cuda.is_available()`` on every op it dispatches; under Lightning's
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` each call loads NVML (a failed library search without a GPU): the planner's
    mode asks once per measurement."""
    calls = []
    available = torch.cuda.is_available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or available())
    model = TinyViT(depth=2)
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    measure_activations(model, blocks, torch.randn(2, 3, 32, 32))
    assert 1 <= len(calls) <= 2, len(calls)
