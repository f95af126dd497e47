"""Fine-tuning the classification and detection examples from a run: the DINO teacher, the EMA or an exported file
read back in (through the safe reader), layer-wise learning-rate decay, drop-path in training only, a frozen backbone.

The worked example of examples/README.md through the examples' CLIs (single-process ``Trainer.fit`` under
VitScaleStrategy: DINO pretraining -> linear probe from the teacher -> export), the rest in-process on a DINO
folder written by the package's save path. Mutations seen failing: the teacher read as the student
(``TEACHER = "student"``); the head prefix not allowed missing; ``layer_decay_scale`` counting blocks from the top;
``DropPath`` active in eval; ``freeze_backbone`` leaving the blocks trainable.

The detector (its ViTDet backbone from the same files; the pyramid and heads kept at init) is tested in-process
alike, and once through its CLI under VitScaleStrategy (frozen backbone from the DINO folder, two steps). Mutations
seen failing: the class token kept, or the last position dropped instead of its; a classifier run's head not left
out; the teacher read as the student; the whole detector as the load target; no or top-down layer decay; the
pyramid frozen, or the backbone trainable; a tiny drop-path rate at 0; ``WindowBlock`` ignoring its rate; the
detector's options unchecked at construction.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from examples import detection
from examples.classification import ViTClassifier, main
from examples.detection import ViTDetector
from examples.models.finetune import load_pretrained
from examples.models.vit import VisionTransformer
from lightning_vitscale.__main__ import main as vitscale
from lightning_vitscale.checkpoint import CheckpointError
from lightning_vitscale.checkpoint.consolidate import load_consolidated
from tests.helpers.saved_runs import save_dino_run, save_run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def dino(tmp_path_factory) -> Path:
    return save_dino_run(tmp_path_factory.mktemp("dino") / "last.ckpt")


def saved(path: Path, prefix: str, weights: str = "raw") -> dict[str, torch.Tensor]:
    state = load_consolidated(path, weights=weights)["state_dict"]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def tiny_vit(**kwargs) -> VisionTransformer:
    return VisionTransformer.from_size("tiny", 16, 1, 10, **kwargs)


@pytest.mark.parametrize(("key", "module", "prefix", "weights"), [
    ("teacher", None, "teacher.backbone.", "raw"),
    ("ema", "student.backbone", "student.backbone.", "ema"),
    ("model", "student.backbone", "student.backbone.", "raw"),
])
def test_the_chosen_weights_of_a_run_are_what_the_backbone_starts_from(dino, key, module, prefix, weights) -> None:
    net = tiny_vit()
    head = net.head.weight.clone()
    load_pretrained(net, str(dino), key, module)
    want = saved(dino, prefix, weights)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in want.items()) and len(want) == len(net.state_dict()) - 2
    assert torch.equal(net.head.weight, head)  # a new head: 10 classes, not the run's


def test_an_exported_teacher_file_loads_and_an_ambiguous_run_names_the_fix(dino, tmp_path) -> None:
    exported = tmp_path / "teacher.safetensors"
    assert vitscale(["export", str(dino), str(exported), "--weights", "teacher", "--module", "backbone"]) == 0
    net = tiny_vit()
    load_pretrained(net, str(exported))
    assert torch.equal(net.blocks[0].attn.qkv.weight, saved(dino, "teacher.backbone.")["blocks.0.attn.qkv.weight"])
    with pytest.raises(ValueError, match="'student.backbone', 'teacher.backbone'.*--model.weights_module"):
        load_pretrained(tiny_vit(), str(dino), "model")


def test_layer_decay_gives_each_depth_its_learning_rate() -> None:
    cli = main(["--trainer.accelerator=cpu", "--model.layer_decay=0.5", "--model.drop_path=0.1", "--model.lr=1.0",
                "--trainer.logger=false"], run=False)  # the fine-tuning command's options, through the CLI
    module = cli.model
    assert isinstance(module, ViTClassifier) and module.hparams["drop_path"] == 0.1
    module.configure_model()
    assert module.net.blocks[-1].drop_path.p == 0.1
    module._trainer = SimpleNamespace(estimated_stepping_batches=10)  # what adamw_cosine asks the trainer
    optimizer = module.configure_optimizers()["optimizer"]
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    lr = {n: lr_of[id(p)] for n, p in module.named_parameters()}
    depth = len(module.net.blocks)  # 4: head and norm 1, block 3 0.5, block 0 0.5**4, stem 0.5**5
    assert lr["net.head.weight"] == lr["net.norm.weight"] == 1.0
    assert [lr[f"net.blocks.{i}.attn.qkv.weight"] for i in range(depth)] == [0.5 ** (depth - i) for i in range(depth)]
    assert lr["net.patch_embed.proj.weight"] == lr["net.pos_embed"] == lr["net.cls_token"] == 0.5 ** (depth + 1)
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.05}


def test_drop_path_rises_with_depth_and_acts_in_training_only() -> None:
    torch.manual_seed(0)
    plain, dropped = tiny_vit(), tiny_vit(drop_path_rate=0.5)
    dropped.load_state_dict(plain.state_dict())
    assert [b.drop_path.p for b in dropped.blocks] == pytest.approx([0.0, 1 / 6, 1 / 3, 0.5])
    x = torch.randn(8, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(dropped.eval()(x), plain.eval()(x))
        assert not torch.allclose(dropped.train()(x), plain.train()(x))


# The worked example of examples/README.md ("Pretrain, fine-tune, export"), each command as given there plus
# the flags that keep it to seconds: one process, two steps.
PRETRAIN = ["fit", "--trainer.accelerator=cpu", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.dirpath=runs/dino", "--trainer.callbacks.save_last=true"]
PROBE = ["fit", "--trainer.accelerator=cpu", "--model.weights=runs/dino/last.ckpt", "--model.weights_key=teacher",
         "--model.freeze_backbone=true"]
EXPORT = ["export", "runs/dino/last.ckpt", "dino_teacher_timm", "--format", "timm", "--weights", "teacher",
          "--module", "backbone", "--arch", "vit_tiny_patch16_224", "--arch-args"]
QUICK = ["--trainer.devices=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
         "--trainer.enable_progress_bar=false", "--data.batch_size=16"]


def test_pretrain_then_linear_probe_from_the_teacher_then_export(tmp_path, monkeypatch) -> None:
    """The DINO run's sharded folder (VitScaleStrategy, Lightning's ModelCheckpoint) -> a linear probe that
    trains the head only, from the teacher -> the teacher as timm weights."""
    import timm

    from examples import pretraining

    monkeypatch.chdir(tmp_path)
    pretraining.main([*PRETRAIN, *QUICK])
    run = Path("runs/dino/last.ckpt")
    assert run.is_dir()  # sharded
    cli = main([*PROBE, *QUICK, "--model.drop_path=0.1", "--trainer.enable_checkpointing=false"])
    net = cli.model.net

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    assert isinstance(net.blocks[0].attn.qkv.weight, DTensor)  # sharded by the strategy
    teacher = saved(run, "teacher.backbone.")
    assert not torch.equal(teacher["blocks.0.attn.qkv.weight"], saved(run, "student.backbone.")[
        "blocks.0.attn.qkv.weight"])  # two steps apart: the choice matters
    for name, p in net.named_parameters():
        if name.startswith("head."):
            assert p.requires_grad and p.grad is not None
        else:  # frozen: no gradient, no step; still the teacher's weights after two steps
            assert not p.requires_grad and p.grad is None and torch.equal(full(p.detach()), teacher[name]), name
    params = [p for g in cli.trainer.optimizers[0].param_groups for p in g["params"]]
    assert {id(p) for p in params} == {id(net.head.weight), id(net.head.bias)}
    assert cli.trainer.global_step == 2

    args = {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 0, "embed_dim": 64, "depth": 4,
            "num_heads": 4, "mlp_ratio": 2.0}
    assert vitscale([*EXPORT, json.dumps(args)]) == 0
    exported = timm.create_model("local-dir:dino_teacher_timm", pretrained=True).state_dict()
    assert exported.keys() == teacher.keys() and all(torch.equal(exported[k], v) for k, v in teacher.items())


# The detection example: the same options, the run's ViT into the ViTDet backbone (no class token, no head).
def detector(**kwargs) -> ViTDetector:
    """The detector on the DINO run's data shape (grey 16 x 16, patch 4), built with a fixed seed."""
    module = ViTDetector(in_chans=1, img_size=16, patch_size=4, **kwargs)
    torch.manual_seed(1)
    module.configure_model()
    return module


def as_backbone(vit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ViT classifier's weights as the ViTDet backbone takes them: no class token (nor its position), no head."""
    out = {k: v for k, v in vit.items() if k != "cls_token" and not k.startswith("head.")}
    return out | {"pos_embed": vit["pos_embed"][:, 1:]}


@pytest.mark.parametrize(("key", "module", "prefix", "weights"), [
    ("teacher", None, "teacher.backbone.", "raw"),
    ("ema", "student.backbone", "student.backbone.", "ema"),
])
def test_a_run_starts_the_detector_backbone_and_leaves_pyramid_and_head_at_init(dino, key, module, prefix,
                                                                                 weights) -> None:
    fresh = detector().net.state_dict()
    net = detector(weights=str(dino), weights_key=key, weights_module=module).net
    want = as_backbone(saved(dino, prefix, weights))
    got = net.state_dict()
    assert {f"backbone.{k}" for k in want} == {k for k in got if k.startswith("backbone.")}
    for name, value in got.items():
        if name.startswith("backbone."):  # every backbone tensor is the file's, every matrix unlike the init
            assert torch.equal(value, want[name[len("backbone."):]]), name
            assert value.ndim < 2 or not torch.equal(value, fresh[name]), name
        else:
            assert torch.equal(value, fresh[name]), name  # pyramid, head: the detector's own init


def test_a_classification_run_and_an_exported_teacher_start_the_detector(dino, tmp_path) -> None:
    torch.manual_seed(0)
    classifier = ViTClassifier(img_size=16, in_chans=1)  # the classification example's run: net.*, a 10-class head
    classifier.configure_model()
    run = save_run(tmp_path / "cls.ckpt", classifier)
    exported = tmp_path / "teacher.safetensors"
    assert vitscale(["export", str(dino), str(exported), "--weights", "teacher", "--module", "backbone"]) == 0
    for path, vit in ((run, saved(run, "net.")), (exported, saved(dino, "teacher.backbone."))):
        want = as_backbone(vit)
        backbone = detector(weights=str(path)).net.backbone.state_dict()
        assert backbone.keys() == want.keys() and all(torch.equal(backbone[k], v) for k, v in want.items()), path


def test_detection_layer_decay_scales_the_backbone_by_depth_and_not_the_pyramid_or_head() -> None:
    cli = detection.main(["--trainer.accelerator=cpu", "--model.layer_decay=0.5", "--model.drop_path=0.1",
                          "--model.lr=1.0", "--trainer.logger=false"], run=False)  # the options through the CLI
    module = cli.model
    assert isinstance(module, ViTDetector) and module.hparams["drop_path"] == 0.1
    module.configure_model()
    blocks = module.net.backbone.blocks
    assert blocks[-1].drop_path.p == 0.1
    module._trainer = SimpleNamespace(estimated_stepping_batches=10)
    optimizer = module.configure_optimizers()["optimizer"]
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    lr = {n: lr_of[id(p)] for n, p in module.named_parameters()}
    depth = len(blocks)
    assert [lr[f"net.backbone.blocks.{i}.attn.qkv.weight"] for i in range(depth)] == [
        0.5 ** (depth - i) for i in range(depth)]
    assert lr["net.backbone.patch_embed.proj.weight"] == lr["net.backbone.pos_embed"] == 0.5 ** (depth + 1)
    rest = {n: v for n, v in lr.items() if not n.startswith(("net.backbone.blocks.", "net.backbone.patch_embed.",
                                                               "net.backbone.pos_embed"))}
    assert any(n.startswith("net.pyramid.") for n in rest) and any(n.startswith("net.head.") for n in rest)
    assert set(rest.values()) == {1.0}  # the pyramid, the heads (and the backbone's final norm, as classification's)


def test_detection_drop_path_zero_is_todays_forward_and_rises_with_depth() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 1, 16, 16)
    today, plain, dropped = detector().net, detector(drop_path=0.0).net, detector(drop_path=0.5).net
    for block in today.backbone.blocks:
        block.drop_path = torch.nn.Identity()  # the blocks' residual sums as before drop-path existed
    assert [b.drop_path.p for b in dropped.backbone.blocks] == pytest.approx([0.0, 1 / 6, 1 / 3, 0.5])
    with torch.no_grad():
        want = today.train()(x)
        assert all(torch.equal(a, b) for level, ref in zip(plain.train()(x), want) for a, b in zip(level, ref))
        assert all(torch.equal(a, b) for level, ref in zip(dropped.eval()(x), today.eval()(x))
                   for a, b in zip(level, ref))
        assert not torch.allclose(dropped.train()(x)[0][0], want[0][0])


def test_detection_freeze_backbone_trains_the_pyramid_and_heads_only() -> None:
    module = detector(freeze_backbone=True)
    trainable = {n for n, p in module.net.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in module.net.named_parameters() if not n.startswith("backbone.")}
    module._trainer = SimpleNamespace(estimated_stepping_batches=10)
    optimizer = module.configure_optimizers()["optimizer"]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in module.net.parameters() if p.requires_grad}


@pytest.mark.parametrize("cls", [ViTClassifier, ViTDetector])
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"weights": "no/such/run"}, FileNotFoundError, "--model.weights=no/such/run: no such file"),
    ({"weights_key": "teacher"}, ValueError, "choose what --model.weights reads: give --model.weights=PATH"),
    ({"weights_module": "backbone"}, ValueError, "choose what --model.weights reads"),
    ({"layer_decay": 0.0}, ValueError, r"layer_decay 0.0 must be in \(0, 1\]"),
    ({"layer_decay": 1.5}, ValueError, r"layer_decay 1.5 must be in \(0, 1\]"),
    ({"drop_path": 1.0}, ValueError, r"drop-path rate 1.0 must be in \[0, 1\)"),
])
def test_bad_fine_tuning_options_fail_at_construction_naming_the_fix(cls, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        cls(**kwargs)


def test_an_ambiguous_run_names_the_fix_for_the_detector_too(dino) -> None:
    with pytest.raises(ValueError, match="'student.backbone', 'teacher.backbone'.*--model.weights_module"):
        detector(weights=str(dino))


DETECT = ["fit", "--trainer.accelerator=cpu", "--model.weights_key=teacher", "--model.freeze_backbone=true",
          "--trainer.enable_checkpointing=false", "--data.num_train=32", "--data.num_val=8", "--data.num_workers=0"]


def test_a_frozen_detector_backbone_from_the_teacher_trains_under_the_strategy(dino, tmp_path) -> None:
    """Two steps under VitScaleStrategy (one process): the blocks sharded, frozen and still the teacher's, the
    pyramid and heads stepped."""
    cli = detection.main([*DETECT, *QUICK, f"--model.weights={dino}", f"--data.cache_dir={tmp_path}"])
    net = cli.model.net
    teacher = saved(dino, "teacher.backbone.")
    block = net.backbone.blocks[0].attn.qkv.weight
    assert isinstance(block, DTensor) and torch.equal(block.full_tensor(), teacher["blocks.0.attn.qkv.weight"])
    for name, p in net.named_parameters():
        assert p.requires_grad == (not name.startswith("backbone.")), name
        assert (p.grad is not None) == p.requires_grad, name
    assert cli.trainer.global_step == 2


@pytest.mark.parametrize("cls", [ViTClassifier, ViTDetector])
def test_weights_from_a_folder_with_a_flipped_byte_are_refused_naming_the_file(dino, tmp_path, cls) -> None:
    """``--model.weights=FOLDER`` checks the CRC-32s its save recorded (issue 49: a corrupt shard was read as weights).
    Mutation seen failing: ``read_weights`` without ``verify`` passed on (the model started from the flipped value)."""
    folder = tmp_path / "last.ckpt"
    shutil.copytree(dino, folder)
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    model = cls(weights=str(folder), weights_key="teacher")
    with pytest.raises(CheckpointError, match=re.escape(f"{shard} fails its CRC-32 check")):
        model.configure_model()
