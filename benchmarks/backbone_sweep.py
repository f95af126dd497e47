"""Any backbone, tried: published vision architectures (timm, Hugging Face transformers, torchvision) at random init,
each trained 2 steps (fp32, or ``--precision bf16-mixed``: DDP's AMP O1 against the recipe's O2) under DDP and under
``VitScaleStrategy()`` with no argument on 2 CPU ranks, from the same weights and data. Per architecture: the
largest relative difference of the two runs' losses, whether the planner measured the step (the speed-first
default) or fell back (its summary says "could not run"), the units it built, and any error, either strategy's.

Usage (ranks started by torch's launcher; ~10 min for the first wave's 58 architectures on 2 cores)::

    python -m torch.distributed.run --nproc-per-node=2 benchmarks/backbone_sweep.py --json sweep.json
    python -m torch.distributed.run --nproc-per-node=2 benchmarks/backbone_sweep.py --only hf/ --only tv/swin_t
    python -m torch.distributed.run --nproc-per-node=2 benchmarks/backbone_sweep.py --o2-by-hand --json o2.json

``--o2-by-hand`` runs bf16-mixed and, beside it, the recipe's O2 written out by hand (the tests' oracle,
``tests/helpers/o2_reference.py``): a gap to DDP's AMP O1 is then O2's own arithmetic if VitScaleStrategy's losses and
state equal the hand-written O2's bit for bit.

What the zoo of ``tests/distributed/test_zoo.py`` checks on every CI run (16 layouts, bf16 and tensor parallelism
included) this widens to the architectures users bring, too slow for CI. Small configurations keep each fit in
seconds: timm's smallest variant of each family at the smallest image size it accepts, HF configs of width 32.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
import traceback
import warnings
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy

# timm: (name, image size)
TIMM = [("vit_tiny_patch16_224", 32), ("deit_tiny_distilled_patch16_224", 32), ("beitv2_base_patch16_224", 32),
        ("swin_tiny_patch4_window7_224", 224), ("swinv2_tiny_window8_256", 256), ("eva02_tiny_patch14_224", 224),
        ("cait_xxs24_224", 32), ("xcit_nano_12_p16_224", 32), ("levit_128s", 224), ("pvt_v2_b0", 64),
        ("twins_svt_small", 64), ("mvitv2_tiny", 224), ("maxvit_tiny_tf_224", 224), ("coat_lite_tiny", 64),
        ("crossvit_tiny_240", 240), ("tnt_s_patch16_224", 32), ("volo_d1_224", 224), ("efficientformer_l1", 224),
        ("convnext_atto", 64), ("vit_small_patch14_dinov2", 28), ("vit_base_patch16_siglip_224", 32),
        ("poolformer_s12", 64), ("fastvit_t8", 64), ("hiera_tiny_224", 224), ("davit_tiny", 224),
        ("focalnet_tiny_srf", 64), ("nextvit_small", 224), ("vit_little_patch16_reg4_gap_256", 32),
        ("flexivit_small", 240), ("sam2_hiera_tiny", 224), ("mambaout_femto", 64), ("tiny_vit_5m_224", 224),
        ("efficientvit_b0", 64), ("gcvit_xxtiny", 224), ("edgenext_xx_small", 64),
        ("vit_medium_patch16_rope_reg1_gap_256", 32), ("hgnetv2_b0", 64),
        # The second wave (2026-12-07): layouts the first did not have (an LSTM mixer, pooling-based ViTs, nested
        # hierarchies, gated convolutions, re-parameterised blocks, dense connections).
        ("sequencer2d_s", 64), ("pit_ti_224", 224), ("visformer_tiny", 224), ("nest_tiny", 224), ("convit_tiny", 32),
        ("starnet_s1", 64), ("rdnet_tiny", 64), ("inception_next_tiny", 64), ("repvit_m1", 64),
        ("swiftformer_xs", 224), ("fasternet_t0", 64), ("efficientformerv2_s0", 224), ("mobilevit_xxs", 64),
        ("vitamin_small_224", 224)]
_W = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_PYRAMID = dict(hidden_sizes=[8, 16, 32, 64])
_SWIN = dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4)
# Hugging Face: (model class, config class, config, input shape without the batch)
HF = [
    ("ViTForImageClassification", "ViTConfig", dict(_W, image_size=32, patch_size=8), (3, 32, 32)),
    ("DeiTForImageClassification", "DeiTConfig", dict(_W, image_size=32, patch_size=8), (3, 32, 32)),
    ("Dinov2ForImageClassification", "Dinov2Config", dict(_W, image_size=32, patch_size=8), (3, 32, 32)),
    ("BeitForImageClassification", "BeitConfig", dict(_W, image_size=32, patch_size=8,
                                                      use_relative_position_bias=True), (3, 32, 32)),
    ("Data2VecVisionForImageClassification", "Data2VecVisionConfig", dict(_W, image_size=32, patch_size=8),
     (3, 32, 32)),
    ("SwinForImageClassification", "SwinConfig", _SWIN, (3, 32, 32)),
    ("Swinv2ForImageClassification", "Swinv2Config", _SWIN, (3, 32, 32)),
    ("ConvNextForImageClassification", "ConvNextConfig", dict(_PYRAMID, depths=[1, 1, 2, 1]), (3, 32, 32)),
    ("ConvNextV2ForImageClassification", "ConvNextV2Config", dict(_PYRAMID, depths=[1, 1, 2, 1]), (3, 32, 32)),
    ("SegformerForImageClassification", "SegformerConfig", dict(_PYRAMID, depths=[1, 1, 1, 1],
                                                                num_attention_heads=[1, 2, 4, 8],
                                                                decoder_hidden_size=32), (3, 64, 64)),
    ("MobileViTForImageClassification", "MobileViTConfig", dict(image_size=64, hidden_sizes=[32, 48, 64],
                                                                neck_hidden_sizes=[8, 8, 16, 16, 32, 32, 64]),
     (3, 64, 64)),
    ("PvtV2ForImageClassification", "PvtV2Config", dict(_PYRAMID, depths=[1, 1, 1, 1],
                                                        num_attention_heads=[1, 2, 4, 8]), (3, 64, 64)),
    ("VideoMAEForVideoClassification", "VideoMAEConfig", dict(_W, image_size=32, patch_size=8, num_frames=4,
                                                              tubelet_size=2), (4, 3, 32, 32)),
    ("TimesformerForVideoClassification", "TimesformerConfig", dict(_W, image_size=32, patch_size=8, num_frames=4),
     (4, 3, 32, 32)),
    ("VivitForVideoClassification", "VivitConfig", dict(_W, image_size=32, num_frames=4, tubelet_size=[2, 8, 8]),
     (4, 3, 32, 32)),
    ("HieraForImageClassification", "HieraConfig", dict(embed_dim=16, image_size=[64, 64], patch_stride=[4, 4],
                                                        num_heads=[1, 2, 4, 8], depths=[1, 1, 2, 1],
                                                        mask_unit_size=[4, 4], query_stride=[2, 2]), (3, 64, 64)),
    # The second wave (2026-12-07): convolutional token embeddings, learned latents cross-attending to pixels, an
    # attention-bias cache, focal modulation, pooling mixers.
    ("CvtForImageClassification", "CvtConfig", dict(embed_dim=[16, 32, 64], num_heads=[1, 2, 4]), (3, 64, 64)),
    ("PerceiverForImageClassificationLearned", "PerceiverConfig", dict(
        num_latents=16, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=2, num_cross_attention_heads=1, image_size=16), (3, 16, 16)),
    ("LevitForImageClassification", "LevitConfig", dict(image_size=64, hidden_sizes=[32, 48, 64],
                                                        num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
                                                        key_dim=[8, 8, 8]), (3, 64, 64)),
    ("FocalNetForImageClassification", "FocalNetConfig", dict(embed_dim=16, depths=[1, 1, 2, 1], image_size=64),
     (3, 64, 64)),
    ("PoolFormerForImageClassification", "PoolFormerConfig", dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]),
     (3, 64, 64)),
]
# torchvision: (builder, keyword arguments, input shape without the batch)
TORCHVISION = [("vit_b_16", dict(image_size=32), (3, 32, 32)), ("swin_t", {}, (3, 64, 64)),
               ("swin_v2_t", {}, (3, 64, 64)), ("maxvit_t", {}, (3, 224, 224)), ("convnext_tiny", {}, (3, 64, 64)),
               # video (channels, frames, height, width), the second wave
               ("video.swin3d_t", {}, (3, 4, 32, 32)), ("video.r2plus1d_18", {}, (3, 4, 32, 32))]
CLASSES, BATCH, STEPS = 10, 2, 2


def timm_model(name: str, image: int) -> nn.Module:
    import timm

    try:
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, img_size=image)
    except TypeError:  # a family without an img_size argument
        return timm.create_model(name, pretrained=False, num_classes=CLASSES)


def hf_model(model: str, config: str, **options) -> nn.Module:
    import transformers

    return getattr(transformers, model)(getattr(transformers, config)(num_labels=CLASSES, **options))


def torchvision_model(name: str, **options) -> nn.Module:
    import torchvision

    builder: object = torchvision.models
    for part in name.split("."):  # "video.swin3d_t": torchvision.models.video.swin3d_t
        builder = getattr(builder, part)
    return builder(num_classes=CLASSES, **options)  # type: ignore[operator]


Architecture = tuple[Callable[[], nn.Module], tuple[int, ...]]
ARCHITECTURES: dict[str, Architecture] = {
    **{f"timm/{name}": (functools.partial(timm_model, name, image), (3, image, image)) for name, image in TIMM},
    **{f"hf/{model}": (functools.partial(hf_model, model, config, **options), shape)
       for model, config, options, shape in HF},
    **{f"tv/{name}": (functools.partial(torchvision_model, name, **options), shape)
       for name, options, shape in TORCHVISION},
}


class Classifier(L.LightningModule):
    def __init__(self, make: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.net, self.losses = make(), []

    def training_step(self, batch, batch_idx):
        out = self.net(batch[0])
        logits = getattr(out, "logits", out)  # an HF model's output
        loss = F.cross_entropy(logits, batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return _sgd(self.parameters())


def _data(shape: tuple[int, ...]) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = BATCH * STEPS * 2
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def fit(architecture: Architecture, strategy, precision: str, made: list | None = None) -> tuple[list[float], str]:
    """``made``: the LightningModule is appended there (its state after the fit)."""
    make, shape = architecture
    torch.manual_seed(0)
    model = Classifier(make)
    if made is not None:
        made.append(model)
    data = _data(shape)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision=precision)
    trainer.fit(model, DataLoader(data, batch_size=BATCH))
    plan = getattr(trainer.strategy, "plan", None)
    return model.losses, plan.summary() if plan is not None else ""


class _Logits(nn.Module):
    """The network as :class:`Classifier` holds it (``net``), returning logits (an HF model returns an output)."""

    def __init__(self, make: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.net = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return getattr(out, "logits", out)


def o2_by_hand(name: str, row: dict, model: nn.Module) -> None:
    """The recipe's O2 written out by hand (the tests' oracle, ``tests/helpers/o2_reference.py``) from the same
    weights and data, against the bf16-mixed ``model`` VitScaleStrategy trained: losses, and the state's entries
    that differ."""
    import sys
    from pathlib import Path

    import torch.distributed as dist

    root = str(Path(__file__).resolve().parents[1])  # run as a script: the repository, for the tests' helper
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.helpers.o2_reference import differing_entries, train_o2_by_hand

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    make, shape = ARCHITECTURES[name]
    torch.manual_seed(0)
    row["o2_by_hand"], expected = train_o2_by_hand(functools.partial(_Logits, make), _data(shape), batch_size=BATCH,
                                                   steps=STEPS, optimizer=_sgd)
    state = model.state_dict()
    row["state_entries_different"] = differing_entries(state, expected)
    row["state_entries_compared"] = len(expected)
    row["state_max_relative_difference"] = max(
        ((state[k].cpu().double() - v.double()).norm() / v.double().norm().clamp_min(1e-30)).item()
        for k, v in expected.items() if k in state and v.is_floating_point())
    row["vitscale_vs_o2_by_hand"] = _max_relative_difference(row["vitscale"], row["o2_by_hand"])


def _max_relative_difference(ours: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, reference, strict=True))


def run(name: str, precision: str, checkpointing: str | None = None, by_hand: bool = False) -> dict:
    row: dict = {"name": name}
    start = time.monotonic()
    options = {} if checkpointing is None else {"activation_checkpointing": {"full": True}.get(checkpointing,
                                                                                                 checkpointing)}
    made: list[nn.Module] = []
    for key, strategy in (("ddp", "ddp"), ("vitscale", VitScaleStrategy(**options))):
        try:
            row[key], summary = fit(ARCHITECTURES[name], strategy, precision, made)
        except Exception as error:  # noqa: BLE001 - a failure is a row of the table
            row[f"{key}_error"] = f"{type(error).__name__}: {error}"[:500]
            row[f"{key}_trace"] = traceback.format_exc()[-2000:]
            continue
        if key == "vitscale":
            row["measured"] = "could not run" not in summary
            row["units"] = next((line.split(":", 1)[1].strip() for line in summary.splitlines()
                                 if line.strip().startswith("FSDP units")), "")
    if by_hand and "vitscale" in row:
        try:
            o2_by_hand(name, row, made[-1])
        except Exception as error:  # noqa: BLE001 - a failure is a row of the table
            row["o2_by_hand_error"] = f"{type(error).__name__}: {error}"[:500]
    if "ddp" in row and "vitscale" in row:
        row["max_relative_difference"] = _max_relative_difference(row["vitscale"], row["ddp"])
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="names starting with this (repeatable)")
    parser.add_argument("--precision", help="both strategies' (default 32-true; bf16-mixed: DDP's is AMP O1)")
    parser.add_argument("--checkpointing", choices=["full", "selective"],
                        help="VitScaleStrategy(activation_checkpointing=...) instead of no argument")
    parser.add_argument("--o2-by-hand", action="store_true",
                        help="bf16-mixed, and the recipe's O2 written out by hand (the tests' oracle) beside: does"
                             " VitScaleStrategy's O2 give its losses and state, bit for bit?")
    parser.add_argument("--json", help="rank 0 writes every row here")
    args = parser.parse_args()
    if args.o2_by_hand and args.precision not in (None, "bf16-mixed"):
        parser.error("--o2-by-hand compares bf16-mixed with O2 by hand; leave --precision out")
    args.precision = args.precision or ("bf16-mixed" if args.o2_by_hand else "32-true")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    rows = []
    for name in ARCHITECTURES:
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        row = run(name, args.precision, args.checkpointing, args.o2_by_hand)
        rows.append(row)
        if rank0:
            difference = row.get("max_relative_difference")
            said = "" if difference is None else f"{difference:.1e}"
            error = row.get("vitscale_error") or row.get("ddp_error") or row.get("o2_by_hand_error") or ""
            hand = "" if "o2_by_hand" not in row else (
                f"  by hand: losses {row['vitscale_vs_o2_by_hand']:.1e}, state entries different"
                f" {len(row['state_entries_different'])} of {row['state_entries_compared']}"
                f" (largest relative difference {row['state_max_relative_difference']:.1e})")
            print(f"{name:45s} {said:>8s}  measured={row.get('measured')}  {row['seconds']:5.1f} s  {error[:120]}"
                  f"{hand}", flush=True)
    if rank0 and args.json:
        with open(args.json, "w") as file:
            json.dump({"torch": torch.__version__, "lightning": L.__version__, "precision": args.precision,
                       "checkpointing": args.checkpointing, "o2_by_hand": args.o2_by_hand, "rows": rows}, file,
                      indent=1)


if __name__ == "__main__":
    main()
