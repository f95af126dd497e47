"""Block discovery on real model families, built on the meta device (no weights, milliseconds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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


def test_the_branches_of_an_inception_block_are_its_parts():
    """GoogLeNet's Inception block holds a lone convolution, two alike ``Sequential`` s of two convolutions and a
    pooling branch: the convolutions of those two were found as blocks (39 units over 63% of GoogLeNet's parameters),
    now the Inception block is (12 over 85%; S3D's 40 over 68% now 13 over 95%); Inception v3's blocks hold their
    convolutions directly, alike, and stay cut finer. Mutation seen failing: ``_in_branches`` always False."""
    tv = pytest.importorskip("torchvision")
    with torch.device("meta"):
        assert discovered(tv.models.googlenet(aux_logits=False, init_weights=False)) == {
            "BasicConv2d": 3, "Inception": 9}
        assert discovered(tv.models.video.s3d()) == {"Conv3dNormActivation": 4, "SepInceptionBlock3D": 9}


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


class ConvNormAct(nn.Sequential):
    """torchvision's ``Conv2dNormActivation``: a container, compared by what it holds."""

    def __init__(self, cin: int, cout: int, depthwise: bool = False) -> None:
        kernel = 3 if depthwise else 1
        super().__init__(nn.Conv2d(cin, cout, kernel, padding=kernel // 2, groups=cin if depthwise else 1, bias=False),
                         nn.BatchNorm2d(cout), nn.SiLU())


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, 2, 1), nn.Conv2d(2, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True)))).sigmoid()


class MBConv(nn.Module):
    """EfficientNet's block: expand, depthwise, squeeze-excite, project, in one ``Sequential`` (``bare``: the
    projection a bare convolution and norm, MobileNetV2's ``InvertedResidual``)."""

    def __init__(self, c: int = 8, bare: bool = False) -> None:
        super().__init__()
        middle = [ConvNormAct(c, 4 * c), ConvNormAct(4 * c, 4 * c, depthwise=True)]
        tail = [nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c)] if bare else [SqueezeExcite(4 * c),
                                                                                       ConvNormAct(4 * c, c)]
        self.block = nn.Sequential(*middle, *tail)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class ConvAroundTransformer(nn.Module):
    """MobileViT's block: convolutions before and after a stack of transformer blocks."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.local, self.project = ConvNormAct(c, c, depthwise=True), ConvNormAct(c, 2 * c)
        self.transformer = nn.Sequential(*(nn.TransformerEncoderLayer(2 * c, 2, 4 * c) for _ in range(2)))
        self.fuse = ConvNormAct(2 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.local(x))
        n, c, h, w = y.shape
        y = self.transformer(y.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(n, c, h, w)
        return x + self.fuse(y)


class FocalBlock(nn.Module):
    """FocalNet's block: a stack of single depthwise convolutions (1% of the block) beside its projections and MLP."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.focal_layers = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c), nn.GELU())
                                          for _ in range(3))
        self.norm, self.proj = nn.LayerNorm(c), nn.Linear(c, 2 * c)
        self.mlp = nn.Sequential(nn.Linear(2 * c, 8 * c), nn.GELU(), nn.Linear(8 * c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x
        for layer in self.focal_layers:
            context = layer(context)
        y = self.proj(self.norm((x + context).permute(0, 2, 3, 1)))
        return x + self.mlp(y).permute(0, 3, 1, 2)


@pytest.mark.parametrize("bare", [False, True])
def test_the_parts_of_one_block_are_no_blocks_the_block_they_make_is(bare):
    """An MBConv's convolutions repeat (three ``ConvNormAct`` in its ``Sequential``) and hold most of it, the shape of
    a stage's blocks; beside its squeeze-excite (or its bare projection) they are parts: the MBConv is the unit.
    Before, each convolution was a unit and the rest of every MBConv stayed in the outer unit (torchvision's
    EfficientNet-B0: 36% of its parameters in units). Mutation seen failing: ``_alike_siblings`` always True."""
    stages = nn.Sequential(*(nn.Sequential(*(MBConv(bare=bare) for _ in range(3))) for _ in range(2)))
    assert discovered(stages) == {"MBConv": 6}


def test_parts_inside_a_stage_make_the_module_holding_them_a_block():
    """A stage of an MBConv and MobileViT's block: the convolutions around the transformer are parts of the block
    that holds them, which is then the unit with its transformer blocks inside (before, its convolutions stayed in
    the outer unit). Mutation seen failing: ``_made_by`` returning the part's parent as is (the MBConv's
    ``Sequential`` a block in its stead)."""
    stages = nn.Sequential(*(nn.Sequential(MBConv(), ConvAroundTransformer()) for _ in range(2)))
    blocks = find_blocks(stages)
    assert [name for name, _ in blocks] == ["0.0", "0.1", "1.0", "1.1"]
    assert describe_blocks(blocks) == {"MBConv": 2, "ConvAroundTransformer": 2}


def test_a_stack_of_single_layers_inside_a_block_leaves_the_block_the_unit():
    """FocalNet's focal convolutions are a ``ModuleList`` of two or more alike modules (a layer stack, as a network's
    blocks) but each one convolution: the block is the unit. Before, they were (timm's FocalNet-T: 24 units over
    1% of the model). Mutation seen failing: ``_is_layered`` always True."""
    assert discovered(nn.Sequential(FocalBlock(), FocalBlock(), FocalBlock())) == {"FocalBlock": 3}


def test_hybrid_and_convolutional_families_are_split_by_their_blocks():
    """The library models the rules above were found on, built on the meta device (torchvision and timm)."""
    tv = pytest.importorskip("torchvision")
    timm = pytest.importorskip("timm")
    with torch.device("meta"):
        assert discovered(tv.models.maxvit_t()) == {"MaxVitLayer": 11}  # was its attention layers and convolutions
        assert discovered(tv.models.mobilenet_v2()) == {"Conv2dNormActivation": 2, "InvertedResidual": 17}
        assert discovered(tv.models.efficientnet_b0())["MBConv"] == 15
        assert discovered(timm.create_model("maxvit_tiny_tf_224")) == {"MaxxVitBlock": 11}
        assert discovered(timm.create_model("focalnet_tiny_srf")) == {"FocalNetBlock": 12}
        assert discovered(timm.create_model("tnt_s_patch16_224")) == {"Block": 12}  # was its inner and outer parts


class Bottleneck(nn.Module):
    """HF ResNet's layout: a shortcut beside a ``Sequential`` of three alike conv layers of other widths each."""

    def __init__(self, c: int = 16, first: bool = False) -> None:
        super().__init__()
        self.shortcut = ConvNormAct(c, c) if first else nn.Identity()
        self.layer = nn.Sequential(ConvNormAct(c, c // 4), ConvNormAct(c // 4, c // 4, depthwise=True),
                                   ConvNormAct(c // 4, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.layer(x)


def test_alike_parts_whose_widths_change_are_one_block_s():
    """Three alike conv layers, no two of the same shapes (1x1 down, 3x3, 1x1 up), are one bottleneck's parts; a
    stage's blocks after its first repeat exactly, so they stay the blocks (and two alike layers, a basic block's,
    still count as a stack). Before, HF's ResNet-50 was 48 units of its conv layers (88% of it); now 16 bottlenecks.
    Mutation seen failing: ``_widths_change`` always False."""
    stages = nn.Sequential(*(nn.Sequential(Bottleneck(first=True), Bottleneck(), Bottleneck()) for _ in range(2)))
    assert discovered(stages) == {"Bottleneck": 6}
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.ResNetForImageClassification(transformers.ResNetConfig())
    assert discovered(model) == {"ResNetBottleNeckLayer": 16}
