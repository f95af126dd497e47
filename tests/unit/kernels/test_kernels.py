"""Kernel policy, fused optimizer and per-block compile, checked on CPU (one tiny compile, marked slow)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_vitscale.kernels import KernelPolicy, attention
from lightning_vitscale.kernels.attention import AttentionBackend, AttentionRouter, route_blocks
from lightning_vitscale.kernels.compile import apply_regional_compile
from lightning_vitscale.kernels.optimizers import fuse_optimizers
from lightning_vitscale.kernels.settings import EAGER, resolve_kernels
from lightning_vitscale.precision.norms import ReplicatedNorms
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import ParallelConfig
from lightning_vitscale.sharding.activation_checkpointing import apply_activation_checkpointing
from lightning_vitscale.sharding.fsdp import shard_module
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from tests.helpers.models import SdpaBlocks

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_eager_on_cpu_and_full_on_cuda():
    assert resolve_kernels("auto", CPU, ()) == EAGER
    assert resolve_kernels("eager", CUDA, ("xformers",)) == EAGER
    cuda = resolve_kernels("auto", CUDA, ("xformers",))
    assert cuda.compile_blocks and cuda.fused_optimizer and cuda.attention == "auto" and not cuda.compile_outer
    assert resolve_kernels(cuda, CUDA, ("xformers",)) is cuda  # resolving twice changes nothing
    # Without a usable attention candidate, "auto" attention is plain SDPA: no router, no timing.
    assert resolve_kernels("auto", CUDA, ()).attention == "sdpa"
    assert resolve_kernels(KernelPolicy(attention="auto"), CPU, ()).attention == "sdpa"
    custom = KernelPolicy(fused_optimizer=True)
    assert resolve_kernels(custom, CPU, ()) is custom


def test_unknown_modes_raise_naming_the_choices():
    with pytest.raises(ValueError, match="auto, eager"):
        resolve_kernels("fast", CPU, ())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sdpa"):
        KernelPolicy(attention="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CUDA-graph"):
        KernelPolicy(compile_mode="reduce-overhead")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_fuse_keeps_hyper_parameters_and_explicit_choices():
    m = _model()
    adam = torch.optim.AdamW(
        [{"params": m[0].parameters(), "lr": 0.1}, {"params": m[2].parameters(), "weight_decay": 0.5}], lr=0.01
    )
    explicit = torch.optim.Adam(m.parameters(), foreach=True)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)  # DTensor has no rule for the fused SGD op: left alone
    changed = fuse_optimizers([adam, explicit, sgd])
    assert changed == ["optimizer 0 (AdamW): fused=True in 2 of 2 param group(s)"]
    assert [g["lr"] for g in adam.param_groups] == [0.1, 0.01]
    assert [g["weight_decay"] for g in adam.param_groups] == [0.01, 0.5]
    assert all(g["fused"] and g["foreach"] is False for g in adam.param_groups)
    assert explicit.param_groups[0]["fused"] is None and sgd.param_groups[0]["fused"] is None


@pytest.mark.parametrize("make", [torch.optim.AdamW, torch.optim.Adam])
def test_fused_step_on_sharded_params_matches_foreach(mesh, make):
    models = []
    for fused in (False, True):
        m = _model()
        shard_module(m, mesh, MixedPrecisionPolicy(), False)
        opt = make(m.parameters(), lr=0.1, weight_decay=0.1)
        if fused:
            assert fuse_optimizers([opt])
        else:
            opt.param_groups[0]["foreach"] = True
        for step in range(3):
            torch.manual_seed(step)
            m(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        models.append(m)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6)


def scaled_math_attention(q, k, v, *, dropout_p=0.0, scale=None, is_causal=False):
    """A stand-in for xformers that computes visibly differently from SDPA (twice the scale), so the test can
    tell from the numbers alone that the compiled graph called it."""
    return ((q @ k.transpose(-2, -1)) * (2 * q.shape[-1] ** -0.5)).softmax(-1) @ v


@pytest.mark.slow
def test_compiled_routed_blocks_and_outer_layers_match_eager(mesh):
    """The pipeline's order: norms -> attention routing -> checkpoint -> compile -> fully_shard, with the outer
    head compiled too. ~20-40 s with a cold inductor cache.

    The fp32-norm hooks are included (in fp32, to compare tightly): their parameter swap inside the checkpoint
    region is what makes dynamo give up on the whole block without `dynamo_options`; entering the attention
    router there is the same kind of side effect. Those options hold only while the compiled modules run.
    """
    defaults = dynamo_settings()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    plain = SdpaBlocks()
    eager, model = copy.deepcopy(plain), copy.deepcopy(plain)
    backend = AttentionBackend("math", scaled_math_attention, lambda device: True)
    route_blocks(list(eager.blocks), AttentionRouter(backend=backend))

    norms = ReplicatedNorms([m for m in model.modules() if isinstance(m, nn.LayerNorm)], mesh, torch.float32)
    blocks = list(model.blocks)
    route_blocks(blocks, AttentionRouter(backend=backend))
    apply_activation_checkpointing(blocks)
    assert apply_regional_compile([*blocks, model.head]) == {"Block": 2, "Linear": 1}
    for block in blocks:
        shard_module(block, mesh, MixedPrecisionPolicy(), True, norms.ignored())
    shard_module(model, mesh, MixedPrecisionPolicy(), False, norms.ignored())

    x = torch.randn(2, 5, 16, requires_grad=True)
    for _ in range(2):  # the second step must reuse the compiled code
        out = model(x)
        out.sum().backward()
    expected = eager(x)
    (expected.sum() * 2).backward()  # two accumulated backwards, like the model above

    # fp32 on CPU: inductor reorders reductions, so compare to 1e-5 relative / 1e-5 absolute, not bitwise.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    # ... and the stand-in really ran inside the compiled blocks: SDPA's numbers are far away.
    assert (plain(x) - out).abs().max() > 1e-2
    # Both blocks (and the second step) ran one graph, the head another: identical blocks share compiled code.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert not torch._dynamo.utils.counters["graph_break"]
    # ... and the process-wide settings are the user's again.
    assert dynamo_settings() == defaults


def dynamo_settings() -> tuple[int, bool]:
    config = torch._dynamo.config
    return config.recompile_limit, config.skip_fwd_side_effects_in_bwd_under_checkpoint


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.slow
def test_bf16_pipeline_compiled_matches_eager(mesh, monkeypatch):
    """The production path through `parallelize`: bf16-mixed O2, fp32 norms, the blocks' attention forced to a
    routed kernel, blocks and outer layers compiled, against the same pipeline left eager. bf16 tolerance:
    inductor keeps fused intermediates in fp32 where eager rounds each op to bf16, so the two differ by a few
    bf16 ulps: relative error (L2) below 2e-2 for the output and every gradient."""
    stand_in = AttentionBackend("xformers", scaled_math_attention, lambda device: True)
    monkeypatch.setattr(attention, "CANDIDATES", (stand_in,))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    plain, x = SdpaBlocks(dim=32), torch.randn(4, 9, 32)
    results = []
    for compiled in (False, True):
        model = copy.deepcopy(plain)
        kernels = KernelPolicy(compile_blocks=compiled, compile_outer=compiled, attention="xformers")
        root = OuterUnit(model)
        done = parallelize(root, model, mesh, ParallelConfig(kernels=kernels), resolve_flag("bf16-mixed"), CPU)
        assert done.plan.kernels["attention"].startswith("xformers") and done.plan.fp32_modules
        out = root(x)
        out.float().square().mean().backward()
        results.append((out, {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    (eager_out, eager_grads), (out, grads) = results
    assert out.dtype == torch.bfloat16
    assert relative_error(out, eager_out) < 2e-2
    for name, grad in grads.items():
        assert relative_error(grad, eager_grads[name]) < 2e-2, name
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_sharded_torch_blocks_really_compile_with_and_without_checkpointing(mesh, checkpointed):
    """FSDP2's hooks are ``dynamo.disable``-d: compiling a block's ``_call_impl`` (``nn.Module.compile``) put them
    inside the compiled region, the call graph-broke there, and for torch's own ``nn.TransformerEncoderLayer``
    without checkpointing dynamo ran the rest eagerly: a "compiled" block compiled nothing. Compiling
    ``forward`` keeps the hooks outside: one graph for all blocks, no graph break, the same numbers as eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True) for _ in range(2)]
    plain, model = nn.Sequential(*copy.deepcopy(layers)), nn.Sequential(*layers)
    blocks = list(model)
    if checkpointed:
        apply_activation_checkpointing(blocks)
    compiler = functools.partial(torch.compile, backend="eager")  # dynamo's capture is what is checked
    assert apply_regional_compile(blocks, compiler=compiler) == {"TransformerEncoderLayer": 2}
    for block in blocks:
        shard_module(block, mesh, MixedPrecisionPolicy(), True, set())
    shard_module(model, mesh, MixedPrecisionPolicy(), False, set())

    x = torch.randn(2, 5, 16, requires_grad=True)  # (an input without grad is one more graph variant)
    out = model(x)
    out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
