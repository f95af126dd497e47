"""Block discovery on real model families, built on the meta device (no weights, milliseconds)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vitscale.discovery.blocks import describe_blocks, find_blocks, reused_modules
from lightning_vitscale.discovery.calls import Calls, recording
from tests.helpers.models import EncoderClassifier, HFViT, ResidualBlock, SmallResNet, timm_vit


def discovered(model: nn.Module) -> dict[str, int]:
    return describe_blocks(find_blocks(model))


@pytest.mark.parametrize(
    "factory, expected",
    [
        (EncoderClassifier, {"TransformerEncoderLayer": 4}),
        (timm_vit, {"Block": 4}),
        (HFViT, {"ViTLayer": 4}),
        (SmallResNet, {"ResidualBlock": 4}),
    ],
)
def test_test_backbones(factory, expected):
    with torch.device("meta"):
        assert discovered(factory()) == expected


def test_torchvision_families():
    tv = pytest.importorskip("torchvision")
    with torch.device("meta"):
        assert discovered(tv.models.resnet50()) == {"Bottleneck": 16}  # blocks of every stage, not the stages
        assert discovered(tv.models.vit_b_16()) == {"EncoderBlock": 12}
        assert discovered(tv.models.video.mvit_v2_s()) == {"MultiscaleBlock": 16}
        swin = discovered(tv.models.swin_t())
        assert swin["SwinTransformerBlock"] == 12


def test_hf_swin_finds_blocks_inside_every_stage():
    transformers = pytest.importorskip("transformers")
    config = transformers.SwinConfig(image_size=64, embed_dim=32, depths=[2, 3, 2], num_heads=[2, 2, 4])
    with torch.device("meta"):
        blocks = find_blocks(transformers.SwinForImageClassification(config))
    assert describe_blocks(blocks) == {"SwinLayer": 7}
    assert blocks[2][0] == "swin.encoder.layers.1.blocks.0"


def test_identical_containers_are_blocks_but_different_ones_are_not():
    def unit(width: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))

    same = nn.Sequential(unit(8), unit(8), unit(8))
    assert describe_blocks(find_blocks(same)) == {"Sequential": 3}
    different = nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Conv1d(8, 8, 1), nn.ReLU()))
    assert find_blocks(different) == []


def test_siblings_held_as_attributes_are_found():
    class TwoBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = ResidualBlock(4), ResidualBlock(4)
            self.head = nn.Linear(4, 2)

    assert [name for name, _ in find_blocks(TwoBlocks())] == ["first", "second"]


def test_two_networks_side_by_side_give_the_blocks_of_both():
    """DINO's student and teacher: each network's head outweighs its blocks, yet a whole network is no block
    (it would be gathered at once). Without the layer-stack rule the two networks were the units."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(ResidualBlock(4) for _ in range(3))
            self.head = nn.Sequential(nn.Linear(4, 256), nn.GELU(), nn.Linear(256, 256))  # > the blocks

    class StudentTeacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student, self.teacher = Net(), Net()

    blocks = find_blocks(StudentTeacher())
    assert describe_blocks(blocks) == {"ResidualBlock": 6}
    assert [n for n, _ in blocks][::3] == ["student.blocks.0", "teacher.blocks.0"]


def test_no_repeated_blocks_gives_nothing():
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == []


def test_overrides_by_class_and_by_predicate_take_outermost_matches():
    model = SmallResNet()
    by_class = find_blocks(model, {ResidualBlock})
    by_predicate = find_blocks(model, lambda name, m: name.startswith("stages.") and name.count(".") == 1)
    assert [n for n, _ in by_class] == [n for n, _ in by_predicate] == [f"stages.{i}" for i in range(4)]
    # A class that also occurs inside a match is not selected again inside it.
    assert len(find_blocks(model, {ResidualBlock, nn.Conv2d})) == 4 + 1  # 4 blocks + the stem conv


def test_shared_module_counts_once():
    shared = ResidualBlock(4)
    model = nn.Sequential(shared, shared, ResidualBlock(4))
    assert len(find_blocks(model)) == 2


def test_a_block_every_layer_shares_is_named_with_its_calls_per_run_outermost_only():
    """ALBERT's layout: no repetition in the structure (no block found), but the shared block runs once per layer;
    counted per call of the model (a measurement may run it twice), outermost (its Linear layers ran 4 times too),
    never a parameter-free module or a lone layer."""
    from tests.helpers.zoo import SharedBlockViT

    model, calls = SharedBlockViT(depth=3), Calls()
    assert find_blocks(model) == []
    with recording(model, calls):
        for _ in range(2):
            model(torch.randn(2, 3, 8, 8))
    assert calls.counts[""] == 2 and calls.counts["layers.fc1"] == 6
    assert [(name, type(m).__name__, times) for name, m, times in reused_modules(model, calls.counts)] == [
        ("layers", "Block", 3)]
    plain, calls = SharedBlockViT(depth=1), Calls()
    with recording(plain, calls):
        plain(torch.randn(2, 3, 8, 8))
    assert reused_modules(plain, calls.counts) == []


def test_experts_run_side_by_side_leave_their_block_the_unit():
    """A Soft-MoE block's experts repeat and hold most of its parameters, the shape of a Swin stage's blocks; the
    structure alone takes them for the blocks (attention and router left in the outer unit, each expert a unit).
    A measured step shows them run side by side (none takes another's output): the block is the unit. A stack's
    blocks feed each other, so a Swin stage's stay the units with the step known too. Mutation seen failing:
    ``_side_by_side`` always False (Expert x12); ``Calls.fed`` naming the module that returned last instead of the
    one whose output the call took (each expert then seems fed by the one before)."""
    from tests.helpers.zoo import SoftMoEViT

    model, calls = SoftMoEViT(), Calls()
    assert discovered(model) == {"Expert": 12}  # the structure alone
    with recording(model, calls):
        model(torch.randn(2, 3, 8, 8))
    assert calls.fed["layers.1"] == "layers.0" and calls.fed["layers.0.experts.1"] == "layers.0.norm2"
    blocks = find_blocks(model, None, calls.called, calls.fed)
    assert describe_blocks(blocks) == {"SoftMoEBlock": 3}


def test_a_swin_stage_s_blocks_stay_the_units_when_the_step_is_known():
    """Mutation seen failing: ``_side_by_side`` ignoring ``fed`` (every stage's blocks then taken as alternatives:
    the stages became the units)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.SwinConfig(image_size=32, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4)
    torch.manual_seed(0)
    model, calls = transformers.SwinForImageClassification(config), Calls()
    with recording(model, calls):
        model(torch.randn(1, 3, 32, 32))
    assert describe_blocks(find_blocks(model, None, calls.called, calls.fed)) == {"SwinLayer": 4}
