"""`python -m lightning_vitscale export`: each format loaded strictly by its own library, 0.0 away from the
consolidated weights, the EMA / DINO-teacher choice honoured, bad input failing with the fix named.

The checkpoints are sharded folders written by the package's own save path (``tests/helpers/saved_runs.py``) from
the DINO example's real module (student, teacher) with an EMA entry, a transformers ViT, a torchvision net.
Mutations seen failing: the prefix not stripped (every format); ``--weights teacher`` reading the student; the
EMA ignored; ``--dtype bf16`` ignored by the CLI; ``write_hf`` without its PreTrainedModel check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from lightning_vitscale.__main__ import main
from lightning_vitscale.checkpoint.consolidate import load_consolidated
from tests.helpers.saved_runs import save_dino_run, save_run

pytestmark = pytest.mark.timeout(120)
TIMM_ARGS = {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 0, "embed_dim": 64, "depth": 4,
             "num_heads": 4, "mlp_ratio": 2.0}


@pytest.fixture(scope="module")
def dino(tmp_path_factory) -> Path:
    return save_dino_run(tmp_path_factory.mktemp("dino") / "last.ckpt")


def consolidated(path: Path, weights: str = "raw") -> dict[str, torch.Tensor]:
    return load_consolidated(path, dtype=torch.float32, weights=weights)["state_dict"]


def under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert (got[k].float() - v.float()).abs().max() == 0.0, k


@pytest.mark.parametrize("weights", ["model", "ema", "teacher"])
def test_safetensors_holds_the_chosen_weights_under_the_backbones_own_names(dino, tmp_path, weights) -> None:
    dst = tmp_path / "backbone.safetensors"
    module = "backbone" if weights == "teacher" else "student.backbone"
    assert main(["export", str(dino), str(dst), "--module", module, "--weights", weights]) == 0
    prefix = {"model": "student.backbone.", "ema": "student.backbone.", "teacher": "teacher.backbone."}[weights]
    want = under(consolidated(dino, "ema" if weights == "ema" else "raw"), prefix)
    assert_same(load_file(dst), want)
    assert "blocks.0.attn.qkv.weight" in want and "cls_token" in want
    with safe_open(dst, "pt") as f:
        meta = f.metadata()
    assert meta["weights"] == weights and meta["global_step"] == "7" and meta["module"] == module


def test_bf16_halves_the_file(dino, tmp_path) -> None:
    dst = tmp_path / "teacher.safetensors"
    assert main(["export", str(dino), str(dst), "--weights", "teacher", "--module", "backbone", "--dtype", "bf16"]) == 0
    got = load_file(dst)
    want = under(consolidated(dino), "teacher.backbone.")
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())


def test_timm_loads_the_teacher_strictly_and_computes_what_the_example_backbone_computes(dino, tmp_path) -> None:
    import timm

    from examples.models.dino import MultiCropViT

    dst = tmp_path / "timm"
    assert main(["export", str(dino), str(dst), "--format", "timm", "--weights", "teacher", "--module", "backbone",
                 "--arch", "vit_tiny_patch16_224", "--arch-args", json.dumps(TIMM_ARGS)]) == 0
    want = under(consolidated(dino), "teacher.backbone.")
    net = timm.create_model("vit_tiny_patch16_224", pretrained=True, **TIMM_ARGS,
                            pretrained_cfg_overlay=dict(file=str(dst / "model.safetensors"), num_classes=0))
    assert_same(net.state_dict(), want)
    assert_same(timm.create_model(f"local-dir:{dst}", pretrained=True).state_dict(), want)  # its config.json
    ours = MultiCropViT("tiny", 16, 1)
    ours.load_state_dict(want, strict=True)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(x), ours.eval()(x))


def test_torchvision_file_loads_strictly(tmp_path) -> None:
    from torchvision.models import get_model

    torch.manual_seed(0)
    wrapper = nn.Module()
    wrapper.net = get_model("squeezenet1_1", weights=None, num_classes=10)
    src = save_run(tmp_path / "run.ckpt", wrapper)
    dst = tmp_path / "squeezenet.pth"
    assert main(["export", str(src), str(dst), "--format", "torchvision", "--module", "net",
                 "--arch", "squeezenet1_1", "--arch-args", '{"num_classes": 10}']) == 0
    fresh = get_model("squeezenet1_1", weights=None, num_classes=10)
    fresh.load_state_dict(torch.load(dst, weights_only=True), strict=True)
    assert_same(fresh.state_dict(), under(consolidated(src), "net."))


class HFModule(pl.LightningModule):
    """A LightningModule around a bare transformers ViTModel (what ``--format hf`` rebuilds from hparams)."""

    def __init__(self, config_dir: str) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        self.save_hyperparameters()
        self.net = AutoModel.from_config(AutoConfig.from_pretrained(config_dir))


def test_hf_folder_of_the_ema_loads_strictly_with_automodel(tmp_path) -> None:
    from transformers import AutoModel, ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
              patch_size=4, num_channels=1).save_pretrained(tmp_path / "config")
    torch.manual_seed(0)
    module = HFModule(str(tmp_path / "config"))
    src = save_run(tmp_path / "hf.ckpt", module, ema_scale=0.25, hyper_parameters=dict(module.hparams))
    dst = tmp_path / "hf"
    assert main(["export", str(src), str(dst), "--format", "hf", "--module", "net", "--weights", "ema",
                 "--model", f"{__name__}:HFModule"]) == 0
    net, info = AutoModel.from_pretrained(dst, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    assert_same(net.state_dict(), under(consolidated(src, "ema"), "net."))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--module", "backbone"], "no submodule 'backbone'.*--module student"),
        (["--weights", "teacher", "--module", "neck"], "no submodule 'neck' in the teacher.*--module backbone"),
        (["--format", "timm", "--module", "student.backbone"], "needs --arch"),
        (["--format", "timm", "--module", "student.backbone", "--arch", "vit_tiny_patch16_224", "--arch-args",
          json.dumps({**TIMM_ARGS, "depth": 2, "mlp_ratio": 4.0})], "do not fit timm.*unexpected.*blocks.2.*mlp.fc1"),
        (["--format", "timm", "--module", "student.backbone", "--arch", "vit_tiny_patch16_224",
          "--arch-args", '{"embed_dim": 64}'], "cannot build timm.*check --arch"),
        (["--format", "hf", "--module", "student.backbone", "--model", "examples.pretraining:DINOPretraining"],
         "needs a transformers PreTrainedModel.*MultiCropViT.*--format safetensors"),
        (["--format", "hf", "--module", "student"], "needs the LightningModule class.*--model"),
    ],
)
def test_bad_input_fails_naming_the_fix(dino, tmp_path, capsys, argv, message) -> None:
    assert main(["export", str(dino), str(tmp_path / "out"), *argv]) == 1
    assert re.search(message, capsys.readouterr().err, flags=re.S)


def test_ema_and_teacher_that_are_not_there_name_the_fix(tmp_path, capsys) -> None:
    src = save_run(tmp_path / "plain.ckpt", nn.Sequential(nn.Linear(2, 2)))
    assert main(["export", str(src), str(tmp_path / "a.safetensors"), "--weights", "ema"]) == 1
    assert "ShardedEMA" in capsys.readouterr().err
    assert main(["export", str(src), str(tmp_path / "a.safetensors"), "--weights", "teacher"]) == 1
    assert "no teacher weights" in capsys.readouterr().err
