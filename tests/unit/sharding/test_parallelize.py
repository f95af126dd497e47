"""The parallelize pipeline on a world-size-1 mesh: plans, overrides and loud failures, without launching ranks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.kernels.compile import is_compiled
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig, ShardingPolicy
from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import NoBlocksMatchedError, parallelize
from tests.helpers.models import EncoderClassifier, HFViT, ResidualBlock, SmallResNet


def run(model: nn.Module, mesh, **policies):
    config = ParallelConfig(
        sharding=ShardingPolicy(**policies.get("sharding", {})),
        checkpointing=CheckpointingPolicy(**policies.get("checkpointing", {})),
    )
    root = OuterUnit(model)
    precision = policies.get("precision", resolve_flag("32-true"))
    done = parallelize(root, model, mesh, config, precision, torch.device("cpu"))
    return root, done.plan


def test_plan_of_a_meta_model(mesh):
    with torch.device("meta"):
        model = EncoderClassifier(depth=6)
    root, plan = run(model, mesh, checkpointing={"blocks": 2})
    assert plan.blocks == {"TransformerEncoderLayer": 6}
    assert plan.units == 7 and isinstance(root, FSDPModule)
    assert plan.checkpointed == ["encoder.layers.1", "encoder.layers.3", "encoder.layers.5"]
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())  # materialised
    assert all(torch.isfinite(p.to_local()).all() for p in model.parameters())
    # Built on meta outside configure_model: nothing recorded its init, so each module's reset_parameters() runs
    # (MultiheadAttention's private _reset_parameters); only `pos` has no initialiser and is zero-filled.
    assert plan.notes == ["1 meta tensor(s) whose init could not be reproduced (warned)"]
    assert model.pos.to_local().abs().sum() == 0
    assert model.encoder.layers[0].self_attn.in_proj_weight.to_local().abs().sum() > 0
    assert plan.num_params == sum(p.numel() for p in model.parameters())
    summary = plan.summary()
    assert "TransformerEncoderLayer x6" in summary and "7 (6 blocks + 1 outer)" in summary
    assert "checkpointed blocks : 3 of 6" in summary


def test_per_block_checkpointing_modes_reach_the_blocks(mesh):
    model = EncoderClassifier(depth=3)
    modes = {"encoder.layers.0": "selective", "encoder.layers.1": "full", "encoder.layers.2": False}
    _, plan = run(model, mesh, checkpointing={"blocks": lambda name, _: modes[name]})
    assert [checkpoint_mode(b) for b in model.encoder.layers] == ["selective", "full", None]
    assert plan.checkpointed == ["encoder.layers.0", "encoder.layers.1"] and plan.selective == ["encoder.layers.0"]
    assert "checkpointed blocks : 2 of 3, 1 selective" in plan.summary()


def _prefetch(unit, direction: str) -> list:
    """The FSDP states ``unit`` prefetches explicitly (FSDP2 keeps them on the unit's state)."""
    return list(getattr(unit._get_fsdp_state(), f"_states_to_{direction}_prefetch") or [])


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_chains_the_units_in_model_order(mesh, depth):
    model = EncoderClassifier(depth=3)
    root, _ = run(model, mesh, sharding={"prefetch": depth})
    units = [root, *model.encoder.layers]
    state = [unit._get_fsdp_state() for unit in units]
    for i, unit in enumerate(units):
        # Not the outer unit (its forward is the whole step): a block gathered there would miss the step's writes.
        assert _prefetch(unit, "forward") == (state[i + 1 : i + 1 + depth] if i >= 1 else [])
        expected_backward = list(reversed(state[max(1, i - depth) : i])) if i >= 1 else []
        assert _prefetch(unit, "backward") == expected_backward


def test_the_first_block_unit_is_gathered_as_its_callers_forward_starts(mesh):
    """Nothing prefetches the first block unit (the outer unit's forward is the whole step: a gather there would
    precede the user's code): the container's forward (``encoder``) issues its all-gather asynchronously, before the
    block's own forward, which waits for it. Mutation seen failing: without ``prefetch_on_entry`` no such call."""
    model = EncoderClassifier(depth=3)
    root, _ = run(model, mesh, sharding={"prefetch": 1})
    first, events = model.encoder.layers[0], []
    gather = first.unshard

    def spy(async_op: bool = False):
        events.append(f"unshard(async_op={async_op})")
        return gather(async_op=async_op)

    first.unshard = spy
    model.encoder.register_forward_pre_hook(lambda *_: events.append("encoder"), prepend=True)
    first.register_forward_pre_hook(lambda *_: events.append("layer 0"))
    root(torch.randn(2, 3, 32, 32))
    assert events[:3] == ["encoder", "unshard(async_op=True)", "layer 0"]


def test_blocks_per_unit_groups_consecutive_blocks(mesh):
    """5 blocks, 2 per unit: units {0, 1}, {2, 3}, {4} and the outer one; each block still gets its starting
    values (built on meta), and explicit prefetch chains the units, not the blocks."""
    with torch.device("meta"):
        model = EncoderClassifier(depth=5)
    root, plan = run(model, mesh, sharding={"blocks_per_unit": 2, "prefetch": 1})
    state = [layer._get_fsdp_state() for layer in model.encoder.layers]
    assert state[0] is state[1] and state[2] is state[3] and len({id(s) for s in state}) == 3
    assert plan.units == 4 and "FSDP units          : 4 (5 blocks, up to 2 per unit + 1 outer)" in plan.summary()
    assert _prefetch(root, "forward") == [] and _prefetch(model.encoder.layers[0], "forward") == [state[2]]
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())
    assert model.encoder.layers[4].self_attn.in_proj_weight.to_local().abs().sum() > 0


def test_no_blocks_means_one_outer_unit_and_a_note(mesh):
    _, plan = run(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), mesh)
    assert plan.units == 1 and plan.blocks == {}
    assert "no repeated blocks" in plan.summary()


@pytest.mark.parametrize("asked", [True, "selective", 2, None, False, "auto"])
def test_checkpointing_asked_of_a_model_without_blocks_warns_that_nothing_is_checkpointed(mesh, asked):
    """No step measured (no call counts): the warning names the fix all the same; left to the plan, nothing."""
    with pytest.warns(UserWarning, match="nothing is checkpointed") if asked not in (None, False, "auto") else (
            warnings.catch_warnings()):
        if asked in (None, False, "auto"):
            warnings.simplefilter("error")
        _, plan = run(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), mesh,
                      checkpointing={"blocks": asked})
    assert plan.units == 1 and "no repeated blocks" in plan.summary()


def test_selector_that_matches_nothing_is_loud(mesh):
    with pytest.raises(NoBlocksMatchedError, match="matched no module with parameters"):
        run(SmallResNet(), mesh, sharding={"blocks": {nn.TransformerEncoderLayer}})


def test_model_without_parameters_is_an_error(mesh):
    with pytest.raises(ValueError, match="has no parameters, so there is nothing to shard"):
        run(nn.Sequential(nn.ReLU()), mesh)


def test_user_selected_blocks(mesh):
    _, plan = run(SmallResNet(), mesh, sharding={"blocks": lambda name, m: name in {"stages.0", "stages.2"}})
    assert plan.block_names == ["stages.0", "stages.2"]


def test_hf_gradient_checkpointing_is_detected_not_doubled(mesh):
    model = HFViT()
    model.vit.gradient_checkpointing_enable()
    _, plan = run(model, mesh)
    assert len(plan.self_checkpointed) == 4 and plan.checkpointed == []
    assert "self-checkpointing" in plan.summary()


def test_sharded_model_computes_what_the_plain_one_does(mesh):
    torch.manual_seed(0)
    plain = SmallResNet()
    sharded = copy.deepcopy(plain)
    root, _ = run(sharded, mesh)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(root(x), plain(x), rtol=0, atol=0)


def test_a_channels_last_model_is_sharded_with_its_values_and_a_note(mesh):
    """``model.to(memory_format=torch.channels_last)``, DDP users' speed habit for convolutional networks, made
    FSDP2 refuse at setup ("does not support non-contiguous parameters yet")."""
    torch.manual_seed(0)
    plain = SmallResNet().to(memory_format=torch.channels_last)
    sharded = copy.deepcopy(plain)
    root, plan = run(sharded, mesh)
    assert any("channels_last parameter(s) made contiguous" in note for note in plan.notes), plan.notes
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    torch.testing.assert_close(root(x), plain(x), rtol=1e-5, atol=1e-6)  # other convolution kernels: rounding


@pytest.mark.parametrize("kept", ["reshard_after_forward=False", "the planner's kept_gathered"])
def test_one_rank_keeps_one_gathered_unit_inside_the_outer_unit(mesh, kept):
    """One rank, all blocks in one unit kept gathered (nothing to overlap, the same memory): the blocks join the
    outer unit, so FSDP2 runs one pre-forward hook per step instead of one per block, and the step computes what
    the plain model does. Mutation tried: apply_fsdp ignoring ``one_unit`` (4 units, every block an FSDPModule)."""
    torch.manual_seed(0)
    plain = SmallResNet()
    model = copy.deepcopy(plain)
    blocks = [name for name, m in model.named_modules() if isinstance(m, ResidualBlock)]
    pinned = kept.startswith("reshard")
    config = ParallelConfig(sharding=ShardingPolicy(blocks_per_unit=len(blocks), reshard_after_forward=False
                                                    if pinned else None))
    root = OuterUnit(model)
    done = parallelize(root, model, mesh, config, resolve_flag("32-true"), torch.device("cpu"),
                       kept_gathered=() if pinned else blocks)
    assert done.plan.units == 1 and not any(isinstance(model.get_submodule(n), FSDPModule) for n in blocks)
    assert f"FSDP units          : 1 (the outer unit, with the {len(blocks)} blocks" in done.plan.summary()
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(root(x), plain(x), rtol=0, atol=0)
    root(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_keys_are_unchanged_by_checkpointing_and_sharding(mesh):
    model = SmallResNet()
    keys = list(model.state_dict())
    run(model, mesh)
    assert list(model.state_dict()) == keys
    assert isinstance(model.stages[0], ResidualBlock)  # blocks stay instances of their own class


class BuildsItsOwnInput(nn.Module):
    """A step that makes an fp32 tensor itself (noise, a mask, a second view) and feeds it to an outer layer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SmallResNet()

    def forward(self, batch_size: int) -> torch.Tensor:
        return self.net(torch.randn(batch_size, 3, 32, 32))  # fp32, made after FSDP's root cast its inputs


def test_outer_layers_take_fp32_tensors_made_inside_a_step(mesh):
    """O2 drop-in: a tensor created in fp32 inside the step reaches a bf16 outer layer (the stem) and still works."""
    model = BuildsItsOwnInput()
    root, plan = run(model, mesh, precision=resolve_flag("bf16-mixed"))
    out = root(2)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert plan.kernels["compiled blocks"] == "off"
    assert any("head" in line for line in plan.tensor_core_misses)  # Linear(16 -> 10): 10 is not a multiple of 8


@pytest.mark.parametrize(
    ("make", "outer"),
    [(EncoderClassifier, ["patch_embed", "head"]), (HFViT, ["vit.vit.embeddings", "vit.classifier"])],
)
def test_compile_outer_compiles_the_largest_subtrees_outside_the_blocks(mesh, make, outer):
    """Nothing runs here (compilation is lazy): the choice of modules is what is checked."""
    torch.manual_seed(0)
    model = make()
    config = ParallelConfig(kernels=KernelPolicy(compile_outer=True))
    done = parallelize(OuterUnit(model), model, mesh, config, resolve_flag("bf16-mixed"), torch.device("cpu"))
    compiled = [name for name, m in model.named_modules() if is_compiled(m)]
    assert compiled == outer  # blocks stay eager (compile_blocks is off); fp32 norms are never compiled alone
    assert done.plan.kernels["compiled outer"] == ", ".join(outer)
    assert done.plan.kernels["compiled blocks"] == "off"
    assert "compiled outer" in done.plan.summary()


def test_a_module_sharded_with_other_blocks_per_unit_is_not_reused():
    from lightning_vitscale.sharding.setup import ShardedModuleReuseError, check_reusable, sharding_signature

    precision, cpu = resolve_flag("32-true"), torch.device("cpu")
    used = sharding_signature(ParallelConfig(), precision, 2, cpu)
    wanted = sharding_signature(ParallelConfig(sharding=ShardingPolicy(blocks_per_unit=2)), precision, 2, cpu)
    with pytest.raises(ShardedModuleReuseError, match="blocks_per_unit= None -> 2"):
        check_reusable(used, wanted)
