"""The one launch of ``scripts/examples_matrix.py`` (2 CPU ranks) that test_backbones_and_pretraining.py and
test_fast_dev_run.py both read: every fit of theirs in one process group, so the launcher, the ranks' start and
the examples' imports are paid once, not once per file (a launch cost ~7 s before any fit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.launch import assert_ok, torchrun
from tests.helpers.results import load_ranks

MATRIX = "tests/examples/scripts/examples_matrix.py"
STRATEGIES = ("vitscale", "ddp")
SOURCES = ("timm", "torchvision", "hf")
# what each scenario is: a classification backbone source, the pretraining example, the video example's MViTv2-S
FITS = (*SOURCES, "dino", "video-mvit_v2_s")
# Every fit runs under both strategies but torchvision's under ddp (8 s of a ViT-B's 86M parameters broadcast and
# all-reduced over gloo): its code path is torchvision/vitscale's (the example's `_torchvision` builder, the grey
# stem) and then Lightning's DDPStrategy, which the timm and hf fits run under ddp with the same CLI.
RUNS = tuple(f"{what}/{s}" for what in FITS for s in STRATEGIES if f"{what}/{s}" != "torchvision/ddp")


def _local_backbone_files(work: Path) -> None:
    """A timm ViT-Ti state dict saved for 7 classes at 32 px RGB (the run adapts it to digits: 10 classes, 16 px,
    grey) and a tiny Hugging Face ViT config directory."""
    import timm
    from safetensors.torch import save_file
    from transformers import ViTConfig

    net = timm.create_model("vit_tiny_patch16_224", num_classes=7, img_size=32, in_chans=3)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(work / "timm.safetensors"))
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=4)
    config.save_pretrained(str(work / "hf_config"))


@pytest.fixture(scope="session")
def example_fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    """Each rank's results (``<fit>/<strategy>`` -> dict) and the launch's output."""
    out, work = tmp_path_factory.mktemp("matrix"), tmp_path_factory.mktemp("weights")
    _local_backbone_files(work)
    result = torchrun(MATRIX, str(out), str(work), ",".join(RUNS), timeout=360)
    assert_ok(result)
    return load_ranks(out), result.output
