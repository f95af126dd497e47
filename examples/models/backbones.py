"""Published backbones for the classification example: timm, torchvision or Hugging Face, by name.

``--model.backbone`` takes ``timm:<model name>`` (``timm:vit_base_patch16_224``), ``torchvision:<builder>``
(``torchvision:vit_b_16``) or ``hf:<config or model directory / id in the local cache>``; the number of classes,
input channels and image size come from the datamodule (the CLI links them), so the head and stem fit the data.
``--model.weights`` names local pretrained weights: a state-dict file (``.safetensors`` or a ``torch.save`` file,
read with ``weights_only=True``) or, for ``hf:``, a directory written by ``save_pretrained``. Nothing is ever
downloaded: a missing file or an id not in the local cache fails at once saying so.

The strategy needs no hint for any of them: each library keeps its repeated blocks in one container
(timm ``blocks``, torchvision ``encoder.layers``, transformers ``encoder.layer``), which it finds and shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

SOURCES = ("timm", "torchvision", "hf")


def build_backbone(spec: str, num_classes: int, in_chans: int, img_size: int, weights: str | None = None) -> nn.Module:
    """The network ``spec`` names, with a ``num_classes`` head, for ``in_chans`` x ``img_size`` x ``img_size`` input."""
    source, name = parse_spec(spec, weights)
    match source:
        case "timm":
            return _timm(name, num_classes, in_chans, img_size, weights)
        case "torchvision":
            return _torchvision(name, num_classes, in_chans, img_size, weights)
        case _:
            return HFClassifier(name, num_classes, in_chans, img_size, weights)


def parse_spec(spec: str, weights: str | None = None) -> tuple[str, str]:
    """``(source, name)`` of ``spec``; fails naming the expected form, or the weights file that is not there."""
    source, sep, name = spec.partition(":")
    if not sep or not name or source not in SOURCES:
        raise ValueError(
            f"backbone {spec!r}: expected '<source>:<name>' with source one of {SOURCES},"
            " e.g. 'timm:vit_base_patch16_224', 'torchvision:vit_b_16' or 'hf:/path/to/model_dir'"
        )
    require_weights(weights)
    return source, name


def require_weights(weights: str | None) -> None:
    """Fails at once on a ``--model.weights`` path that is not there (nothing is ever downloaded)."""
    if weights is not None and not Path(weights).exists():
        raise FileNotFoundError(f"--model.weights={weights}: no such file or directory (weights are never downloaded)")


def _timm(name: str, num_classes: int, in_chans: int, img_size: int, weights: str | None) -> nn.Module:
    import timm

    # timm itself adapts local weights to the data: new head for other class counts, the patch stem summed
    # over channels for grey input, the position embedding resampled for another image size.
    kwargs: dict[str, Any] = {"num_classes": num_classes, "in_chans": in_chans}
    if weights is not None:
        kwargs |= {"pretrained": True, "pretrained_cfg_overlay": {"file": weights}}
    try:
        return timm.create_model(name, img_size=img_size, **kwargs)
    except TypeError:  # convolutional nets take any input size and have no img_size argument
        return timm.create_model(name, **kwargs)


def _torchvision(name: str, num_classes: int, in_chans: int, img_size: int, weights: str | None) -> nn.Module:
    from torchvision import models

    if in_chans not in (1, 3):
        raise ValueError(f"torchvision:{name} takes RGB input; in_chans={in_chans} (only 1, repeated to 3, is adapted)")
    try:
        net = models.get_model(name, weights=None, num_classes=num_classes, image_size=img_size)
    except TypeError:  # only the ViT builders take image_size
        net = models.get_model(name, weights=None, num_classes=num_classes)
    if weights is not None:
        load_matching(net, read_state_dict(weights), weights)
    return nn.Sequential(GreyToRGB(), net) if in_chans == 1 else net


class GreyToRGB(nn.Module):
    """Repeats a grey channel three times, so RGB stems (and their pretrained weights) take grey images."""

    def forward(self, x: Tensor) -> Tensor:
        return x.expand(-1, 3, -1, -1)


class HFClassifier(nn.Module):
    """A transformers image classifier that returns plain logits (the steps treat every backbone alike)."""

    def __init__(self, ref: str, num_classes: int, in_chans: int, img_size: int, weights: str | None) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForImageClassification

        # local_files_only: a directory, or an id already in the local Hugging Face cache; never a download
        overrides = {"num_labels": num_classes, "num_channels": in_chans, "image_size": img_size}
        config = AutoConfig.from_pretrained(ref, local_files_only=True)
        overrides = {k: v for k, v in overrides.items() if hasattr(config, k)}
        if weights is None:
            config.update(overrides)
            self.model = AutoModelForImageClassification.from_config(config)
        else:  # a save_pretrained directory; the head (other class count) is re-initialised and reported
            self.model = AutoModelForImageClassification.from_pretrained(
                weights, local_files_only=True, ignore_mismatched_sizes=True, **overrides
            )

    def forward(self, x: Tensor) -> Tensor:
        return self.model(pixel_values=x).logits


def read_state_dict(path: str) -> dict[str, Tensor]:
    """Tensors only: safetensors, or a ``torch.save`` file read with ``weights_only=True`` (no pickled code),
    through lightning_vitscale's one safe reader (a Lightning checkpoint gives its ``state_dict``)."""
    from lightning_vitscale.checkpoint.export import read_weights

    return read_weights(path, dtype=None).state


def load_matching(net: nn.Module, state: dict[str, Tensor], source: str, keep: set[str] | None = None) -> None:
    """Load ``state`` into ``net``, keeping ``net``'s own init where shapes differ (head, stem, position table)
    and for the names in ``keep`` that ``state`` lacks (a new classifier head on a pretrained backbone).

    Names must match exactly: a file for another architecture fails, naming the first names it lacks or adds.
    """
    own = net.state_dict()
    missing = sorted(own.keys() - state.keys() - (keep or set()))
    unexpected = sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(
            f"{source} does not fit this backbone: missing {missing[:5]}, unexpected {unexpected[:5]}"
            " (was it saved from the same architecture, as a state_dict?)"
        )
    reshaped = sorted(k for k in own.keys() & state.keys() if own[k].shape != state[k].shape)
    net.load_state_dict({k: v for k, v in state.items() if k not in reshaped}, strict=False)
    kept = sorted(set(reshaped) | (own.keys() - state.keys()))
    rank_zero_info(f"loaded {source}; kept the new init for {kept or 'nothing'} (new, or another shape for this data)")
