"""What the planner measures per block, and how often: blocks that run different code are measured apart, equal
ones once, and a block whose checkpointing is settled only for that checkpointing (a third of the setup work).
A block is measured on the arguments the step gave it, not its input alone (MViT's ``block(x, thw)``)."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.memory import activations, block_passes
from lightning_vitscale.memory.activations import measure_activations
from lightning_vitscale.memory.planner import step_inputs
from lightning_vitscale.memory.step_cost import rates_for
from lightning_vitscale.memory.step_inputs import StepSettings
from lightning_vitscale.memory.step_model import predict_step

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
    real = block_passes.peak_beyond_forward

    def counted(*args, **kwargs):
        calls.append(None)
        return real(*args, **kwargs)

    monkeypatch.setattr(block_passes, "peak_beyond_forward", counted)
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


class Told(nn.Module):
    """MViT's pattern: ``block(x, thw)`` returns ``(x, thw)`` and its ops depend on the shape it is told (windows of
    ``thw[1]`` tokens here); a keyword tensor without a gradient (an additive bias, as HF's attention masks)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, thw: tuple[int, int], bias: torch.Tensor | None = None):
        b, n, d = x.shape
        groups = x.reshape(b * thw[0], thw[1], d)
        mixed = (groups @ groups.transpose(-1, -2)).softmax(-1) @ groups
        out = self.proj(mixed.reshape(b, n, d))
        return (out if bias is None else out + bias), thw


class Baked(Told):
    """The same block told nothing: its shape and bias are its own."""

    def __init__(self, thw: tuple[int, int]) -> None:
        super().__init__()
        self.thw = thw
        self.register_buffer("bias", torch.zeros(DIM))

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        return super().forward(x, self.thw, bias=self.bias)[0]


class TellingNet(nn.Module):
    """Passes each block its window shape, and a bias by keyword; ``baked``: the same net of :class:`Baked` blocks."""

    def __init__(self, shapes: list[tuple[int, int]], baked: bool = False) -> None:
        super().__init__()
        self.shapes = shapes
        self.blocks = nn.ModuleList(Baked(s) if baked else Told() for s in shapes)
        self.register_buffer("bias", torch.zeros(DIM))
        self.baked = baked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, thw in zip(self.blocks, self.shapes, strict=True):
            x = block(x) if self.baked else block(x, thw, bias=self.bias)[0]
        return x


SHAPES = [(4, TOKENS // 4), (TOKENS, 1)]  # 4 windows of 8 tokens, then 32 windows of one: other attention work


def test_a_block_called_with_more_arguments_is_measured_on_them_as_the_same_block_told_nothing(monkeypatch):
    """Before, a block was measured alone on its first input: ``block(x)`` raised on MViT's ``block(x, thw)``, so
    ``VitScaleStrategy()`` could not plan for speed and checkpointed every block. Blocks told other shapes run other
    ops and are measured apart. Mutations seen failing: the block replayed on its input alone (TypeError); the
    pass's key without the arguments (the second block's work is the first's)."""
    monkeypatch.setattr(activations, "_PASSES", {})
    example = torch.empty(BATCH, TOKENS, DIM)
    told, baked = TellingNet(SHAPES), TellingNet(SHAPES, baked=True)
    measured = [measure_activations(net, [(f"blocks.{i}", b) for i, b in enumerate(net.blocks)], example).blocks
                for net in (told, baked)]
    assert measured[0] == measured[1]
    linear = 2 * BATCH * TOKENS * DIM * DIM
    assert [b.work.flops for b in measured[0]] == [attention_flops(TOKENS // 4) + linear, attention_flops(1) + linear]
    assert all(b.recompute > 0 and b.backward > 0 and b.selective_backward > 0 for b in measured[0])


class PlainTableNet(nn.Module):
    """HF VideoMAE's pattern: a fixed position table kept as a plain tensor attribute (neither a parameter nor a
    buffer: the measurement's fake tensors do not replace it), added in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(1, TOKENS, DIM)
        self.blocks = nn.ModuleList([Attending(4), Attending(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.table.detach().to(x.device)
        for block in self.blocks:
            x = block(x)
        return x


class TellingClassifier(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net, self.head = net, nn.Linear(DIM, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.net(x).mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("net", [functools.partial(TellingNet, SHAPES), PlainTableNet], ids=["told", "plain_table"])
def test_the_default_plans_for_speed_a_model_whose_blocks_take_more_arguments_or_that_holds_a_plain_tensor(net):
    """Through ``Trainer.fit``: ``VitScaleStrategy()`` measures the step and takes the planner's plan (memory to
    spare: nothing checkpointed), not the recipe's fallback for a step it could not measure. A plain tensor
    attribute met a fake tensor in an op and failed the measurement until 2026-12-03 (HF's VideoMAE).
    Mutation seen failing: the fake mode without ``allow_non_fake_inputs`` (plain_table: "could not run")."""
    from lightning_vitscale import VitScaleStrategy

    data = TensorDataset(torch.randn(8, TOKENS, DIM), torch.randint(0, 4, (8,)))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TellingClassifier(net()), DataLoader(data, batch_size=4))
    summary = trainer.strategy.plan.summary()
    assert "could not" not in summary and "through training_step" in summary, summary
    assert "checkpointed blocks : 0 of 2" in summary, summary
    assert trainer.global_step == 2


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_a_block_every_layer_shares_is_predicted_as_its_layers_unrolled(checkpointing):
    """ALBERT's layout (one block called once per layer, named with ``blocks={Block}``) against the same layers as
    distinct blocks of the same shapes: every call keeps its own activations (checkpointed: its own input, and
    selective its expensive outputs), FSDP2 gathers the shared unit at each call and reduce-scatters it once, and a
    step does each call's work. The kept activations, the gathers and the work are the unrolled model's; the
    parameters (one block's) and the reductions (one) differ. Measured once per block, a shared block kept one
    call's input: its checkpointed step read 1.6x (full) and 4.1x (selective) under a real ``Trainer.fit`` step
    (tests/distributed/test_memory_planner.py's ``shared_tiny`` cells)."""
    from lightning_vitscale.memory.collectives import unit_collectives
    from lightning_vitscale.memory.step_cost import step_time, traffic_per_dimension
    from lightning_vitscale.memory.step_model import step_phases
    from tests.helpers.zoo import Block, PatchClassifier, SharedBlockViT

    torch.manual_seed(0)
    shared = SharedBlockViT(dim=32, depth=4)
    unrolled = PatchClassifier(32, nn.Sequential(*(Block(32, nn.Identity()) for _ in range(4))))
    x = torch.randn(4, 3, 8, 8)
    found = [step_inputs(m, x, world_size=2, precision="32-true", device="cpu", blocks={Block})
             for m in (shared, unrolled)]
    assert [b.calls for b in found[0].profile.blocks] == [4] and [b.calls for b in found[1].profile.blocks] == [1] * 4
    modes = {"none": {}, "full": {"checkpointed": frozenset(range(4))},
             "selective": {"checkpointed": frozenset(range(4)), "selective": frozenset(range(4))}}[checkpointing]

    def settings(inputs):
        blocks = frozenset(range(len(inputs.profile.blocks)))
        return StepSettings(**{k: blocks for k in modes}, blocks_per_unit=1, reshard_after_forward=True)

    ends = [next(p for p in step_phases(i, settings(i)) if p.phase == "end of forward") for i in found]
    assert ends[0].activations == ends[1].activations > 0
    traffic = [traffic_per_dimension(i, settings(i))["data_parallel"] for i in found]
    # Gathered at each call, reduced once a step (autograd sums the calls' gradients: sharding/deferred_reduction.py)
    reduced = [c.sent for c in unit_collectives(found[0].layout.blocks[0], shard=2, gather_itemsize=4,
                                                reduce_itemsize=4, reshard=True) if c.kind == "reduce_scatter"]
    assert traffic[0] == pytest.approx(traffic[1] - 3 * sum(reduced), rel=0.05)  # the outer units differ a little
    work = [sum(b.work.flops for b in i.profile.blocks) for i in found]
    assert work[0] == work[1] > 0
    times = [step_time(i, settings(i), rates_for("cpu")) for i in found]
    assert times[0].seconds == pytest.approx(times[1].seconds, rel=0.05)


def test_blocks_run_on_two_crop_sizes_keep_both_inputs_and_are_measured_on_the_larger():
    """DINO's student runs its backbone once per crop size (batched by size): every block runs twice a step, on
    inputs of different sizes. Checkpointed, each keeps both calls' inputs, and its recompute is at most the larger
    call's; the work is both calls'. Here the smaller call comes first: measured on it and counted once (before
    shared blocks were counted), the kept inputs were a third of the step's."""
    from lightning_vitscale.memory.step_model import _kept_and_inside
    from tests.helpers.zoo import Block

    class TwoSizes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block(32, nn.Identity()) for _ in range(2)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # local crops (half the tokens), then global ones
            return self.blocks(x[:, :8].contiguous()).mean() + self.blocks(x).mean()

    model, x = TwoSizes(), torch.randn(4, 16, 32)
    inputs = step_inputs(model, x, world_size=1, precision="32-true", device="cpu")
    alone = step_inputs(nn.Sequential(model.blocks), x, world_size=1, precision="32-true", device="cpu")
    full = StepSettings(frozenset(range(2)))
    large = 4 * 16 * 32 * 4
    for block, once in zip(inputs.profile.blocks, alone.profile.blocks):
        assert block.calls == 2 and block.share == pytest.approx(1.5)
        assert block.input == once.input == large and block.recompute == once.recompute  # the larger call's
        assert _kept_and_inside(block, 0, full)[0] == large * 3 // 2
        assert block.work.flops == pytest.approx(1.5 * once.work.flops, rel=0.01)
