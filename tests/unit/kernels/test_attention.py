"""Attention routing on CPU: a math stand-in plays xformers (which has CUDA kernels only)."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_vitscale.cli.demo import Block, TinyViT, generated_images
from lightning_vitscale.kernels import KernelPolicy, attention
from lightning_vitscale.kernels.attention import (
    AttentionCall,
    AttentionRouter,
    describe_choice,
    make_router,
    measure,
    routable,
    route_blocks,
)
from lightning_vitscale.sharding.activation_checkpointing import apply_activation_checkpointing
from lightning_vitscale.strategy import VitScaleStrategy
from tests.helpers.attention_stand_in import stand_in, substituted
from tests.helpers.models import SdpaBlocks

CPU = torch.device("cpu")


def qkv(*shape, dtype=torch.float32):
    return tuple(torch.randn(shape, dtype=dtype) for _ in range(3))


def test_routable_keeps_on_sdpa_what_a_stand_in_would_compute_differently():
    q, k, v = qkv(2, 4, 16, 8)
    call = routable((q, k, v), {"is_causal": True, "dropout_p": 0.1})
    assert call == AttentionCall((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), torch.float32, CPU, True, 0.1, None)
    assert "causal" in call.describe() and "q[2, 4, 16, 8] float32" in call.describe()
    assert routable((q, k, v), {"attn_mask": torch.ones(16, 16, dtype=torch.bool)}) is None
    assert routable((q, k, v), {"enable_gqa": True}) is None
    assert routable((q[0], k[0], v[0]), {}) is None  # 3-D
    assert routable((q, k[:, :, :8], v[:, :, :8]), {"is_causal": True}) is None  # causal, 16 queries vs 8 keys
    assert routable((q, k[:, :, :8], v[:, :, :8]), {}) is not None
    assert routable((q, k.double(), v), {}) is None
    assert routable((q, k[:, :2], v[:, :2]), {}) is None


def test_router_serves_forward_and_checkpoint_recompute_and_matches_sdpa():
    torch.manual_seed(0)
    reference = SdpaBlocks()
    model = copy.deepcopy(reference)
    backend = stand_in()
    router = AttentionRouter(backend=backend)
    route_blocks(list(model.blocks), router)
    route_blocks(list(model.blocks), router)  # applying twice is a no-op
    apply_activation_checkpointing(list(model.blocks))
    x = torch.randn(3, 5, 16)
    out = model(x)
    out.sum().backward()
    # One call per block in forward, one more per block when backward recomputes it under the same kernel.
    assert backend.fn.calls == 4
    expected = reference(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]


def test_multihead_attention_stays_on_sdpa():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    backend = stand_in()
    router = AttentionRouter(backend=backend)
    x = torch.randn(2, 5, 16)
    expected = layer(x)
    route_blocks([layer], router)
    torch.testing.assert_close(layer(x), expected)
    assert backend.fn.calls == 0


def test_a_router_with_nothing_to_do_is_never_entered():
    block = Block(16, 2)
    stacks = []
    block.qkv.register_forward_hook(lambda *_: stacks.append(torch.overrides._get_current_function_mode_stack()))
    router = AttentionRouter(candidates=(stand_in(),))  # "auto" before the first step: not recording yet
    route_blocks([block], router)
    block(torch.randn(1, 4, 16))
    with router.record():
        block(torch.randn(1, 4, 16))
    router.decide("sdpa")
    block(torch.randn(1, 4, 16))
    assert [router in stack for stack in stacks] == [False, True, False]
    assert router.recorded and router.decided and router.backend is None
    assert router.calls == Counter(
        {AttentionCall((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), torch.float32, CPU, False, 0.0, None): 1}
    )


def test_policy_per_device(monkeypatch):
    assert make_router("sdpa", CPU) is None
    assert make_router("auto", CPU) is None  # xformers has no CPU kernels: nothing to measure, no mode
    with pytest.raises(RuntimeError, match=r"lightning-vitscale\[xformers\]"):
        make_router("xformers", CPU)
    fake = stand_in(name="xformers")
    monkeypatch.setattr(attention, "CANDIDATES", (fake,))
    auto = make_router("auto", CPU)
    assert auto is not None and not auto.decided and auto.candidates == (fake,)
    assert auto.backend is None and not auto.recording  # blocks do not even enter the mode
    assert attention.describe_router(auto).startswith("auto: sdpa vs xformers")
    forced = make_router("xformers", CPU)
    assert forced is not None and forced.decided and forced.backend is fake
    assert attention.describe_router(forced).startswith("xformers (the blocks'")
    assert attention.describe_router(None).startswith("sdpa")


def test_measure_times_each_shape_once_and_weights_it_by_its_count(monkeypatch):
    small = AttentionCall((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), torch.float32, CPU, False, 0.0, None)
    large = AttentionCall((2, 2, 32, 8), (2, 2, 32, 8), (2, 2, 32, 8), torch.float32, CPU, False, 0.0, None)
    calls = Counter({small: 3, large: 1})
    backend = stand_in()
    totals = measure(calls, [backend])  # real timings, on tiny CPU shapes
    assert set(totals) == {"sdpa", "math"} and all(ms > 0 for ms in totals.values())
    fake_ms = {
        (F.scaled_dot_product_attention, small): 1.0,
        (F.scaled_dot_product_attention, large): 10.0,
        (backend.fn, small): 2.0,
        (backend.fn, large): 5.0,
    }
    monkeypatch.setattr(attention, "time_attention", lambda fn, call: fake_ms[(fn, call)])
    assert measure(calls, [backend]) == {"sdpa": 3 * 1.0 + 10.0, "math": 3 * 2.0 + 5.0}
    line = describe_choice("math", {"sdpa": 13.0, "math": 11.0}, calls)
    assert line.startswith("math (measured") and "sdpa 13.000 ms" in line and "3 x q[1, 2, 8, 4]" in line
    assert "no routable" in describe_choice("sdpa", {"sdpa": 0.0}, Counter())


class Recorder(TinyViT):
    def training_step(self, batch, batch_idx):
        self.calls_before_step.append(self.backend.fn.calls)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("stand_in_wins", [True, False])
def test_auto_records_the_first_step_then_routes(mesh, stand_in_wins):
    """The strategy end to end on one rank: step 1 records (SDPA), step 2 measures, chooses and routes.
    (Two ranks with opposite local timings: tests/distributed/test_lifecycle.py.)"""
    L.seed_everything(0, verbose=False)
    model = Recorder(image=16, dim=32, depth=2)
    model.calls_before_step = []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3,  # every block checkpointed: its recompute is routed too
        strategy=VitScaleStrategy(kernels=KernelPolicy(attention="auto"), activation_checkpointing=True),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with substituted(sdpa_ms=2.0, stand_in_ms=1.0 if stand_in_wins else 3.0) as backend, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.backend = backend
        trainer.fit(model, DataLoader(generated_images(24, image=16), batch_size=8))
    line = trainer.strategy.plan.kernels["attention"]
    # 2 blocks x (forward + checkpoint recompute) per routed step; none in the recording step.
    if stand_in_wins:
        assert model.calls_before_step + [backend.fn.calls] == [0, 0, 4, 8]
        assert line.startswith("math (measured attention fwd+bwd per step: sdpa 4.000 ms, math 2.000 ms")
    else:
        assert backend.fn.calls == 0
        assert line.startswith("sdpa (measured") and "math 6.000 ms" in line
    assert "2 x q[8, 8, 16, 4] float32" in line  # 2 blocks, batch 8, 8 heads, 16 patches, head_dim 4
    assert all(torch.isfinite(torch.tensor(model.losses)))
