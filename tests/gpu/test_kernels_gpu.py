"""Kernels on a real GPU: the full "auto" recipe trains, attention is measured, xformers matches SDPA."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_vitscale.demo import TinyViT, generated_images
from lightning_vitscale.kernels import choose_attention, sdpa_via_xformers, xformers_available
from lightning_vitscale.policies import KernelPolicy, resolve_kernels
from lightning_vitscale.strategy import VitScaleStrategy
from lightning_vitscale.throughput import ThroughputMonitor, device_peak_flops

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_auto_recipe_compiles_blocks_fuses_adamw_and_reports_mfu():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    L.seed_everything(0, verbose=False)
    model = TinyViT(dim=128, depth=4)
    monitor = ThroughputMonitor(log_every_n_steps=4, warmup_steps=3)
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=VitScaleStrategy(kernels="auto"), precision="bf16-mixed",
        max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[monitor],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(generated_images(512), batch_size=32))
    assert all(torch.isfinite(torch.tensor(model.losses)))
    assert model.losses[-1] < model.losses[0]
    assert trainer.optimizers[0].param_groups[0]["fused"] is True
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"]
    if device_peak_flops(CUDA) is not None:
        assert 0 < monitor.metrics["throughput/mfu"] < 1
    assert monitor.metrics["memory/peak_allocated_gib"] > 0


def test_auto_attention_measures_both_backends_when_xformers_is_installed():
    policy = resolve_kernels("auto", CUDA)
    name, timings = choose_attention(policy, (8, 12, 197, 64), torch.bfloat16, CUDA)
    if xformers_available():
        assert set(timings) == {"sdpa", "xformers"} and name == min(timings, key=timings.__getitem__)
    else:
        assert (name, timings) == ("sdpa", {})


@pytest.mark.skipif(not xformers_available(), reason="needs the optional xformers extra")
def test_xformers_route_matches_sdpa():
    q, k, v = (torch.randn(2, 12, 197, 64, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(sdpa_via_xformers(q, k, v), expected, rtol=2e-2, atol=2e-2)
    assert choose_attention(KernelPolicy(attention="xformers"), q.shape, q.dtype, CUDA) == ("xformers", {})


def test_known_gpu_has_a_peak():
    name = torch.cuda.get_device_name(CUDA)
    if any(key in name for key in ("H100", "H200", "A100")):
        assert device_peak_flops(CUDA) is not None
