"""The memory planner on one process: fake-tensor activations vs real ones, "auto" checkpointing against a real
step's measured peak, checkpointing applied to already-sharded blocks, the CLI and the policy's errors."""

from __future__ import annotations

import copy
import dataclasses
import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_vitscale.cli.demo import TinyViT
from lightning_vitscale.kernels.optimizers import prefer_foreach
from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing
from lightning_vitscale.memory.budget import parse_memory
from lightning_vitscale.memory.measurement import Measurement
from lightning_vitscale.memory.plan_search import BlockPlan
from lightning_vitscale.memory.planner import plan_memory, step_inputs
from lightning_vitscale.memory.step_inputs import StepSettings, collective_copies
from lightning_vitscale.memory.step_model import predict_step, step_phases
from lightning_vitscale.memory.twin import meta_twin
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig
from lightning_vitscale.sharding.activation_checkpointing import apply_activation_checkpointing
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from lightning_vitscale.strategy import VitScaleStrategy
from tests.helpers.peak import live_tensor_bytes, step_peak_bytes

LONG = dict(image=64, patch=4, dim=96, depth=4)  # 256 tokens: activations dominate
BATCH = 8


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 64, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def meta_input() -> torch.Tensor:
    return torch.empty(BATCH, 3, 64, 64, device="meta")


def sharded(mesh, names: set[str]) -> tuple[OuterUnit, TinyViT]:
    torch.manual_seed(0)
    model = TinyViT(**LONG)
    root = OuterUnit(model)
    config = ParallelConfig(checkpointing=CheckpointingPolicy(blocks=lambda name, _: name in names))
    parallelize(root, model, mesh, config, resolve_flag("32-true"), torch.device("cpu"))
    return root, model


def measured_step_peak(mesh, names: set[str]) -> int:
    """The peak bytes of a real step of the model sharded with ``names`` checkpointed: its own tensors only (what
    earlier tests left alive in the process is not the step's: it read 5 MiB over the budget in one run)."""
    gc.collect()
    foreign = live_tensor_bytes()
    root, model = sharded(mesh, names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prefer_foreach([optimizer])
    x, y = batch()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(root(x), y).backward()
        optimizer.step()

    step()
    return step_peak_bytes(step, warmup=step)[1] - foreign


def test_fake_activations_match_autograd_on_real_tensors():
    """Saved-for-backward bytes per block on fake tensors equal those of a real forward."""
    with torch.device("meta"):
        planned = TinyViT(**LONG)
    profile = step_inputs(planned, meta_input(), precision="32-true").profile
    real = TinyViT(**LONG)
    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in real.parameters()}  # linear saves views of its weight

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = real.patch_embed(batch()[0]).flatten(2).transpose(1, 2) + real.pos
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        real.blocks[0](x.detach().requires_grad_())
    assert profile.blocks[0].saved == sum(saved.values())
    assert profile.blocks[0].input == x.numel() * 4


def test_the_outer_layers_are_counted_as_a_real_step_holds_them():
    """What the layers around the blocks hold, against a real forward: their saved tensors without the batch (it is
    resident, counted once; the patch embedding's conv saves it as it is in fp32), the part saved after the blocks
    (freed before any block's backward), and, while the blocks' backward runs, the gradients of the outer parameters
    used after the blocks only (the patch embedding and position embedding get theirs after every block's)."""
    with torch.device("meta"):
        planned = TinyViT(**LONG)
    profile = step_inputs(planned, meta_input(), precision="32-true").profile
    real = TinyViT(**LONG)
    images = batch()[0]
    skipped = {p.untyped_storage().data_ptr() for p in real.parameters()} | {images.untyped_storage().data_ptr()}
    owner: list[str] = ["before"]
    saved = {"before": 0, "after": 0}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in skipped and key not in seen:
            seen.add(key)  # a storage counts for whoever saved it first
            if owner[0] != "block":
                saved[owner[0]] += t.untyped_storage().nbytes()
        return t

    real.blocks[0].register_forward_pre_hook(lambda *_: owner.__setitem__(0, "block"))
    real.blocks[-1].register_forward_hook(lambda *_: owner.__setitem__(0, "after"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = real(images)
    assert saved["before"] == 0  # the conv's only saved input is the batch
    assert profile.outer_saved == saved["before"] + saved["after"] and profile.outer_saved_after == saved["after"] > 0
    after = [*real.norm.parameters(), *real.head.parameters()]
    assert profile.outer_backward == sum(p.numel() * 4 for p in after) + 2 * out.numel() * 4


def test_what_the_outer_layers_save_after_the_blocks_is_alive_from_the_forwards_end_to_their_backward():
    from lightning_vitscale.memory.step_model import step_phases

    with torch.device("meta"):
        planned = TinyViT(**LONG)
    inputs = step_inputs(planned, meta_input(), precision="32-true")
    profile, phases = inputs.profile, {p.phase: p for p in step_phases(inputs, StepSettings())}
    before, kept = profile.outer_saved - profile.outer_saved_after, sum(b.saved for b in profile.blocks)
    assert profile.outer_saved_after > 0
    assert phases["all-gather of unit 0"].activations == before
    assert phases["end of forward"].activations == profile.outer_saved + kept
    assert phases["backward of block 3"].activations == before + kept


def test_a_checkpointed_blocks_backward_on_fake_tensors_is_what_the_allocator_sees():
    """A fully checkpointed block's recompute and backward, measured on fake tensors, against torch's CPU allocator
    events on real ones: the recomputed tensors are held by autograd alone (their Python tensors die early), which
    a count through weak references to the tensors missed (0.75x)."""
    from lightning_vitscale.memory.activations import fake_parameters
    from lightning_vitscale.memory.block_passes import peak_beyond_forward
    from lightning_vitscale.memory.fake_modes import FakeMode as _FakeMode

    model = TinyViT(**LONG)
    block = model.blocks[0]
    mode = _FakeMode()
    with fake_parameters(model, mode, torch.float32, lambda _: False):
        with mode:
            fake_input = torch.empty(BATCH, 256, 96)
        predicted = peak_beyond_forward(block, fake_input, mode, torch.utils.checkpoint.noop_context_fn)
    x = torch.randn(BATCH, 256, 96, requires_grad=True)
    held: dict[str, torch.Tensor] = {}

    def forward() -> None:
        x.grad = None
        block.zero_grad(set_to_none=True)
        held["out"] = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)

    def backward() -> None:
        held["out"].backward(torch.ones_like(held["out"]))  # the incoming gradient, as the fake run makes it

    forward()
    backward()
    start, peak = step_peak_bytes(backward, warmup=forward)
    assert predicted == pytest.approx(peak - start, rel=0.1)


def test_auto_checkpoints_about_half_under_a_half_budget_and_stays_within_it(mesh):
    with torch.device("meta"):
        planned = TinyViT(**LONG)
    inputs = step_inputs(planned, meta_input(), precision="32-true")
    every = predict_step(inputs, StepSettings(frozenset(range(4)))).peak
    none = predict_step(inputs, StepSettings()).peak
    budget = (every + none) // 2
    choice = AutoCheckpointing(budget, Measurement(1, "32-true"), blocks_per_unit=1).choose(planned, meta_input())
    assert len(choice.names) == 2, choice.describe()
    assert choice.names == ["blocks.0", "blocks.1"]
    assert measured_step_peak(mesh, set(choice.names)) <= budget


def test_auto_checkpoints_nothing_when_everything_fits(mesh):
    with torch.device("meta"):
        planned = TinyViT(**LONG)
    ample = 4 * 2**30
    choice = AutoCheckpointing(ample, Measurement(1, "32-true"), blocks_per_unit=1).choose(planned, meta_input())
    assert choice.names == []
    assert measured_step_peak(mesh, set()) <= ample


def test_checkpointing_applied_after_sharding_recomputes_and_matches(mesh):
    """What "auto" does at the first step: checkpoint blocks that FSDP already wraps."""
    plain_root, plain = sharded(mesh, set())
    late_root, late = sharded(mesh, set())
    apply_activation_checkpointing([late.blocks[0], late.blocks[1]])
    x, y = batch()
    flops = []
    for root in (plain_root, late_root):
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(root(x), y).backward()
        flops.append(counter.get_total_flops())
    assert flops[1] > flops[0]  # the two blocks ran their forward again in backward
    for a, b in zip(plain.parameters(), late.parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor())


def test_meta_twin_copies_structure_not_data():
    model = TinyViT(**LONG)
    twin = meta_twin(model)
    assert all(p.is_meta for p in twin.parameters())
    assert not any(p.is_meta for p in model.parameters())
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    with pytest.raises(RuntimeError, match="not attached"):
        twin.trainer  # noqa: B018 - a module no Trainer holds gives a twin no Trainer holds
    import lightning as L

    model.trainer = trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert meta_twin(model).trainer is trainer  # a training_step measured on the twin may read self.trainer


def test_meta_twin_of_a_layer_under_the_old_weight_norm():
    """The hook-based ``torch.nn.utils.weight_norm`` (DINO's head) keeps its layer's ``weight`` as an attribute autograd
    computed: ``copy.deepcopy`` refuses it, and the planner's twin failed, so the default planned without its step.
    Its twin stands a meta tensor in for it, which the layer's pre-hook recomputes from the twin's parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.utils.weight_norm(torch.nn.Linear(8, 3)))
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(model)
    twin = meta_twin(model)
    assert twin[1].weight.is_meta and not model[1].weight.is_meta
    assert twin(torch.empty(2, 4, device="meta")).shape == (2, 3)  # the hook recomputed it from meta parameters


def test_plan_names_the_settings_for_a_large_vit():
    from examples.models.vit import VisionTransformer

    with torch.device("meta"):
        net = VisionTransformer.from_size("vit-h14", 224, 3, 1000)
    x = torch.empty(32, 3, 224, 224, device="meta")
    small = plan_memory(net, x, world_size=8, device_memory="a100-40gb")
    tight = plan_memory(net, x, world_size=8, device_memory=8)
    assert small.fits and small.checkpointed == 0
    assert tight.fits and tight.checkpointed > 0
    assert tight.blocks != BlockPlan(32, 0, 32)  # not the least-memory end: a trade within the budget
    assert tight.chosen.breakdown.peak <= tight.budget < small.budget
    assert tight.max_batch < small.max_batch
    assert "recommended: activation_checkpointing" in tight.summary()


def test_cli_plans_an_example_config(capsys):
    from lightning_vitscale.__main__ import main

    code = main(["plan", "--config", "examples/configs/classification_vit_h.yaml", "--model",
                 "examples.classification:ViTClassifier", "--devices", "8", "--nodes", "1", "--memory", "a100-40gb"])
    out = capsys.readouterr().out
    assert code == 0
    assert "32 blocks, 8 rank(s), bf16-mixed, batch 32 per rank" in out and "**peak**" in out


def test_policy_errors_name_the_fix():
    # One budget for every choice the planner makes (units, "auto", accumulation): accepted without "auto" too.
    assert VitScaleStrategy(memory_budget=0.5).config.checkpointing.memory_budget == 0.5
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        CheckpointingPolicy(blocks="auto", memory_budget=1.5)
    with pytest.raises(TypeError, match="int \\(bytes\\) or a float"):
        CheckpointingPolicy(blocks="auto", memory_budget="lots")
    with pytest.raises(TypeError, match="'auto'"):
        CheckpointingPolicy(blocks="some")
    with pytest.raises(ValueError, match="a100-40gb"):
        parse_memory("lots")
    assert CheckpointingPolicy(blocks="auto").mode(0, "b", copy.copy(torch.nn.Linear(1, 1))) is None


def test_auto_keeps_blocks_gathered_when_everything_fits(mesh):
    """An ample budget: no checkpointing, and blocks stay gathered from forward to backward (no second
    all-gather); a tight one: every block checkpointed and resharded after forward as the recipe does."""
    from torch.distributed.tensor import DTensor

    from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing
    from lightning_vitscale.memory.measurement import Measurement
    from lightning_vitscale.sharding.planning import apply_auto_choice

    for ample in (False, True):
        model = TinyViT(**LONG)
        model.example_input_array = batch()[0]
        auto = AutoCheckpointing(4 * 2**30 if ample else 1, Measurement(1, "32-true"))
        names = auto.at_setup(model, torch.device("cpu"), lambda plan: plan).names  # as the strategy: before sharding
        root = OuterUnit(model)
        config = ParallelConfig(checkpointing=CheckpointingPolicy(blocks=False))
        done = parallelize(root, model, mesh, config, resolve_flag("32-true"), torch.device("cpu"))
        apply_auto_choice(model, auto, done.plan)
        loss = F.cross_entropy(root(batch()[0]), batch()[1])
        # Between forward and backward a resharded block holds DTensor shards, a gathered one plain tensors.
        gathered = [not isinstance(block.qkv.weight, DTensor) for block in model.blocks]
        loss.backward()
        assert names == ([] if ample else [f"blocks.{i}" for i in range(4)])
        assert gathered == [ample] * 4


def test_gloo_collective_copies_count_on_cpu_only():
    """gloo copies each all-gather / reduce-scatter through a full-size temporary; NCCL (CUDA) writes in place.

    At batch 1 on 8 ranks in bf16-mixed, a parameter-heavy model's backward peaks while a block's gradients are
    reduce-scattered: on CPU the fp32 reduce-scatter input is held twice (FSDP's buffer + gloo's copy).
    """
    assert collective_copies("cpu") and collective_copies(torch.device("cpu"))
    assert not collective_copies("cuda") and not collective_copies(None)
    with torch.device("meta"):
        planned = TinyViT(image=32, patch=4, dim=256, depth=6)
    x = torch.empty(1, 3, 32, 32, device="meta")
    every = StepSettings(frozenset(range(6)))
    gpu = predict_step(step_inputs(planned, x, world_size=8, precision="bf16-mixed"), every)
    cpu = predict_step(step_inputs(planned, x, world_size=8, precision="bf16-mixed", device="cpu"), every)
    block = sum(p.numel() for p in planned.blocks[0].parameters()) * 4  # fp32 reduce dtype
    assert cpu.phase.startswith("reduce-scatter") and cpu.peak > gpu.peak
    assert cpu.peak - gpu.peak <= block


def test_only_rank_zero_measures_and_every_rank_applies_or_raises_its_outcome(monkeypatch):
    """Every rank would measure the same shapes: rank 0 does, the others take its choice and what its step called
    (tensor_proof reads them), or raise its error (none left waiting in a collective). Mutation seen failing: each
    rank measuring (a measurement counted on rank 1)."""
    from lightning_vitscale.discovery.calls import Calls
    from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing
    from lightning_vitscale.memory.measurement import Measurement, MeasurementError

    model = TinyViT(**LONG)
    model.example_input_array = batch()[0]
    sent: list = []

    def broadcast(value):  # rank 0's side of the collective: what it sends
        sent.append(value)
        return value

    zero = AutoCheckpointing(4 * 2**30, Measurement(1, "32-true"))
    chosen = zero.at_setup(model, torch.device("cpu"), broadcast)
    measured = []
    monkeypatch.setattr(Measurement, "__call__", lambda *args, **kwargs: measured.append(args) or 1 / 0)
    one = AutoCheckpointing(4 * 2**30, Measurement(1, "32-true"), measures=False)
    received = iter(sent)
    other = TinyViT(**LONG)
    other.example_input_array = batch()[0]
    assert one.at_setup(other, torch.device("cpu"), lambda _: next(received)) == chosen and not measured
    assert one.measure.calls.called == zero.measure.calls.called and one.measure.calls.inputs
    failed = MeasurementError("could not run on fake tensors")
    for rank in (True, False):
        auto = AutoCheckpointing(1, Measurement(1, "32-true"), measures=rank)
        monkeypatch.setattr(auto, "choose", lambda *args: (_ for _ in ()).throw(failed))
        with pytest.raises(MeasurementError, match="could not run"):
            auto.at_setup(model, torch.device("cpu"), lambda value: value or (failed, Calls()))


def test_an_outcome_that_cannot_be_pickled_is_measured_by_every_rank(monkeypatch):
    """Rank 0 sends nothing where its outcome cannot travel (an unusual recorded argument); the other ranks then
    measure for themselves and reach the same choice. Mutation seen failing: sending it anyway."""
    from lightning_vitscale.memory import auto_checkpointing
    from lightning_vitscale.memory.auto_checkpointing import AutoCheckpointing
    from lightning_vitscale.memory.measurement import Measurement

    assert not auto_checkpointing._picklable(lambda: 0) and auto_checkpointing._picklable((1, "a"))
    monkeypatch.setattr(auto_checkpointing, "_picklable", lambda value: False)
    choices, sent = [], []
    for measures in (True, False):
        model = TinyViT(**LONG)
        model.example_input_array = batch()[0]
        auto = AutoCheckpointing(4 * 2**30, Measurement(1, "32-true"), measures=measures)
        choices.append(auto.at_setup(model, torch.device("cpu"), lambda value: sent.append(value) or value))
    assert sent[0] is None and choices[0] == choices[1] and choices[1].plan is not None


def test_the_fake_step_meets_each_buffer_in_the_dtype_the_real_step_does():
    """The planner's fake step mirrors convert_module's rule: parameters in the compute dtype (FSDP casts them),
    unsaved buffers in it too, saved ones in their own (fp32, half again the bytes they were counted at), norms fp32."""
    from lightning_vitscale.memory.activations import fake_parameters
    from lightning_vitscale.memory.fake_modes import FakeMode as _FakeMode

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[0].register_buffer("saved", torch.ones(4))
    model[0].register_buffer("unsaved", torch.ones(4), persistent=False)
    with fake_parameters(model, _FakeMode(), torch.bfloat16, lambda m: isinstance(m, torch.nn.BatchNorm1d)):
        assert (model[0].weight.dtype, model[0].unsaved.dtype, model[0].saved.dtype) == (torch.bfloat16,) * 2 + (
            torch.float32,)
        assert model[1].weight.dtype == model[1].running_mean.dtype == torch.float32
    assert model[0].saved.dtype == torch.float32 and not isinstance(model[0].saved, torch._subclasses.FakeTensor)


def test_one_rank_with_one_kept_unit_is_predicted_without_fsdps_collective_buffers():
    """On one rank with every block in one unit kept gathered, the step computes on copies (sharding/
    compute_copies.py): filled in place (no all-gather temporary) and their gradients cast one by one into the fp32
    ones (no reduce-scatter input). A replicated shard group (hybrid sharding) still runs FSDP2's path."""
    with torch.device("meta"):
        planned = TinyViT(**LONG)
    inputs = step_inputs(planned, meta_input(), precision="bf16-mixed")
    one_unit = StepSettings(reshard_after_forward=False, blocks_per_unit=4)
    copies = {phase.phase: phase for phase in step_phases(inputs, one_unit)}
    fsdp = {phase.phase: phase for phase in step_phases(dataclasses.replace(inputs, replicas=2), one_unit)}
    blocks = sum(math.prod(shape) for block in inputs.layout.blocks for shape in block)  # the fp32 norms apart
    assert fsdp["all-gather of unit 0"].transient - copies["all-gather of unit 0"].transient == blocks * 2
    assert fsdp["reduce-scatter of unit 0"].transient - copies["reduce-scatter of unit 0"].transient == blocks * 4
    resharded = StepSettings(blocks_per_unit=4)  # gathered again for backward: FSDP2's units
    assert step_phases(inputs, resharded) == step_phases(dataclasses.replace(inputs, replicas=2), resharded)
