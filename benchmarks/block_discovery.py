"""What block discovery makes the units of published architectures: per family (torchvision, timm, HF transformers,
built on the meta device: no weights, seconds for all), the blocks found by class and count, the units, and the share
of the model's parameters inside them (the rest stays in the outer unit, gathered whole for every step). From the
structure alone, as setup does where it cannot run the step; with the step known it can only drop side-by-side
experts (``discovery/blocks.py``).

Usage::

    python benchmarks/block_discovery.py                 # a markdown table
    python benchmarks/block_discovery.py --json out.json --only maxvit

Its reading (benchmarks/RESULTS.md, "Any backbone"): which families are split by the block a person would name, and
which are cut finer or coarser.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable

import torch
from torch import nn

from lightning_vitscale.discovery.blocks import describe_blocks, find_blocks, find_units

TORCHVISION = ["resnet50", "efficientnet_b0", "efficientnet_v2_s", "mobilenet_v2", "mobilenet_v3_large",
               "regnet_y_400mf", "convnext_tiny", "maxvit_t", "swin_v2_t", "vit_b_16", "densenet121",
               "shufflenet_v2_x1_0", "mnasnet1_0", "resnext50_32x4d", "squeezenet1_0", "googlenet", "inception_v3"]
TORCHVISION_VIDEO = ["mvit_v2_s", "swin3d_t", "r3d_18", "s3d"]
TIMM = ["efficientnet_b0", "mobilenetv3_large_100", "regnety_016", "resnet50", "convnext_tiny", "maxvit_tiny_tf_224",
        "coatnet_0_rw_224", "efficientformer_l1", "levit_128", "mobilevit_s", "fastvit_t8", "repvit_m1",
        "edgenext_small", "poolformer_s12", "caformer_s18", "davit_tiny", "focalnet_tiny_srf", "nest_tiny",
        "crossvit_tiny_240", "tnt_s_patch16_224", "twins_svt_small", "xcit_tiny_12_p16_224", "cait_xxs24_224",
        "deit3_small_patch16_224", "hiera_tiny_224", "eva02_tiny_patch14_224", "vit_small_patch16_224",
        "volo_d1_224", "pit_ti_224", "mvitv2_tiny", "efficientvit_b0", "nextvit_small", "inception_next_tiny",
        "ghostnetv2_100", "fastvit_mci0", "hgnetv2_b0", "rdnet_tiny", "mambaout_femto", "starnet_s1",
        "tiny_vit_5m_224", "vitamin_small_224", "sam2_hiera_tiny"]
HF = [("ViTConfig", "ViTForImageClassification"), ("SwinConfig", "SwinForImageClassification"),
      ("Swinv2Config", "Swinv2ForImageClassification"), ("Dinov2Config", "Dinov2ForImageClassification"),
      ("BeitConfig", "BeitForImageClassification"), ("ConvNextConfig", "ConvNextForImageClassification"),
      ("ConvNextV2Config", "ConvNextV2ForImageClassification"),
      ("SegformerConfig", "SegformerForSemanticSegmentation"), ("DetrConfig", "DetrForObjectDetection"),
      ("VitDetConfig", "VitDetModel"), ("HieraConfig", "HieraForImageClassification"),
      ("SamVisionConfig", "SamVisionModel"), ("DeiTConfig", "DeiTForImageClassification"),
      ("ResNetConfig", "ResNetForImageClassification"), ("RegNetConfig", "RegNetForImageClassification"),
      ("EfficientNetConfig", "EfficientNetForImageClassification"),
      ("MobileViTConfig", "MobileViTForImageClassification"), ("PvtV2Config", "PvtV2ForImageClassification"),
      ("ViTMAEConfig", "ViTMAEForPreTraining"), ("VideoMAEConfig", "VideoMAEForVideoClassification"),
      ("TimesformerConfig", "TimesformerForVideoClassification"), ("VivitConfig", "VivitForVideoClassification"),
      ("CLIPVisionConfig", "CLIPVisionModel"), ("SiglipVisionConfig", "SiglipVisionModel"),
      ("FocalNetConfig", "FocalNetForImageClassification"), ("DPTConfig", "DPTForDepthEstimation"),
      ("Mask2FormerConfig", "Mask2FormerForUniversalSegmentation"),
      ("ConditionalDetrConfig", "ConditionalDetrForObjectDetection"),
      ("DeformableDetrConfig", "DeformableDetrForObjectDetection"), ("RTDetrConfig", "RTDetrForObjectDetection"),
      ("UperNetConfig", "UperNetForSemanticSegmentation"), ("LevitConfig", "LevitForImageClassification"),
      ("PoolFormerConfig", "PoolFormerForImageClassification"),
      ("MaskFormerConfig", "MaskFormerForInstanceSegmentation"),
      ("OneFormerConfig", "OneFormerForUniversalSegmentation"),
      ("GroundingDinoConfig", "GroundingDinoForObjectDetection"),
      ("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification"),
      ("SwiftFormerConfig", "SwiftFormerForImageClassification"), ("CvtConfig", "CvtForImageClassification")]


def families() -> dict[str, Callable[[], nn.Module]]:
    """name -> builder at each library's default configuration (no pretrained weights)."""
    import timm
    import torchvision.models as tvm
    import transformers
    from torchvision.models import video

    def hf(config: str, model: str) -> nn.Module:
        made = getattr(transformers, config)()
        for flag in ("use_pretrained_backbone", "use_timm_backbone"):  # nothing downloaded
            if hasattr(made, flag):
                setattr(made, flag, False)
        return getattr(transformers, model)(made)

    inception = {"aux_logits": False, "init_weights": False}
    found: dict[str, Callable[[], nn.Module]] = {}
    found |= {f"tv/{n}": (lambda n=n: getattr(tvm, n)(**(inception if n in ("googlenet", "inception_v3") else {})))
              for n in TORCHVISION}
    found |= {f"tv/video/{n}": (lambda n=n: getattr(video, n)()) for n in TORCHVISION_VIDEO}
    found |= {f"timm/{n}": (lambda n=n: timm.create_model(n, pretrained=False)) for n in TIMM}
    found |= {f"hf/{model}": (lambda c=config, m=model: hf(c, m)) for config, model in HF}
    return found


def discovered(build: Callable[[], nn.Module]) -> dict:
    try:
        with torch.device("meta"):
            model = build()
    except NotImplementedError:  # an init that reads values (torchvision's RegNet): built on the CPU
        model = build()
    blocks = find_blocks(model)
    total = sum(p.numel() for p in model.parameters())
    covered = sum(p.numel() for _, block in blocks for p in block.parameters())
    return {"units": len(find_units(model)), "blocks": describe_blocks(blocks), "in_units": covered / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--only", action="append", default=[], help="families whose name contains this (repeatable)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = {}
    print("| family | units | blocks found | parameters in units |\n|---|---|---|---|")
    for name, build in families().items():
        if args.only and not any(part in name for part in args.only):
            continue
        try:
            row = rows[name] = discovered(build)
        except Exception as error:  # noqa: BLE001 - a family that cannot be built here is reported, not fatal
            rows[name] = {"error": f"{type(error).__name__}: {str(error)[:120]}"}
            print(f"| {name} | - | {rows[name]['error']} | - |")
            continue
        blocks = ", ".join(f"{cls} x{count}" for cls, count in row["blocks"].items())
        print(f"| {name} | {row['units']} | {blocks} | {row['in_units']:.0%} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
