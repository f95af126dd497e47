"""The library formats of an export, each checked name by name and shape by shape against the model its own
library builds: an HF folder (``config.json`` from the submodule, built on the meta device), a timm folder
(``timm.create_model("local-dir:DIR")``) and a torchvision state-dict file (both named by ``arch``, ``arch_args``).
"""

from __future__ import annotations

import copy
import importlib
import io
import json
from typing import Any

import torch
from torch import Tensor, nn

from lightning_vitscale._compat import timm_save_config_for_hf
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.export.weights import (
    TEACHER,
    Weights,
    WeightsChoice,
    write_bytes,
    write_safetensors,
)
from lightning_vitscale.checkpoint.formats import PathLike, model_shapes, require_match
from lightning_vitscale.checkpoint.storage import Location

WEIGHTS_FILE = "model.safetensors"  # the name transformers and timm look for in a folder


def check_fits(state: dict[str, Tensor], model: nn.Module, what: str) -> None:
    """Every name and shape of ``model.state_dict()`` in ``state`` and nothing else, or an error naming them."""
    require_match(
        model_shapes(model), {k: v.shape for k, v in state.items()}, f"the weights do not fit {what}",
        "Pick the submodule that is this architecture (--module), or the architecture and its arguments that build"
        " this submodule (--arch, --arch-args).",
    )


def build_submodule(
    class_path: str, hyper_parameters: dict[str, Any], module: str, weights: WeightsChoice
) -> nn.Module:
    """Submodule ``module`` (inside ``teacher`` for ``weights="teacher"``) of the LightningModule ``class_path``
    built on the meta device from the saved ``hyper_parameters``: whose own ``config`` an HF folder needs."""
    module_name, sep, attr = class_path.partition(":")
    if not sep:
        module_name, _, attr = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise CheckpointError(
            f"--model {class_path!r}: cannot import it ({error}). Give the LightningModule that trained the run as"
            " `package.module:Class`, importable from here (run from the project's folder)."
        ) from error
    init_args = {k: v for k, v in hyper_parameters.items() if not k.startswith("_")}
    with torch.device("meta"):
        root = cls(**init_args)
        if callable(getattr(root, "configure_model", None)):
            root.configure_model()
    path = ".".join(p for p in ((TEACHER if weights == "teacher" else ""), module.strip(".")) if p)
    try:
        return root.get_submodule(path) if path else root
    except AttributeError as error:
        raise CheckpointError(f"{class_path} has no submodule {path!r} ({error}); check --module.") from error


def write_hf(weights: Weights, dst: PathLike, submodule: nn.Module, dtype: torch.dtype) -> Location:
    """``dst/config.json`` (the submodule's own ``config``) + ``dst/model.safetensors``, for ``from_pretrained``."""
    from transformers import PreTrainedModel

    if not isinstance(submodule, PreTrainedModel):
        raise CheckpointError(
            f"--format hf needs a transformers PreTrainedModel, and the submodule is a {type(submodule).__name__}:"
            " only a PreTrainedModel has the config from_pretrained needs. Pass --module naming the transformers"
            " model inside your LightningModule, or export with --format safetensors (or timm/torchvision --arch)."
        )
    check_fits(weights.state, submodule, type(submodule).__name__)
    config = copy.deepcopy(submodule.config)
    config.architectures = [type(submodule).__name__]
    config.dtype = dtype
    folder = Location.of(dst)
    write_bytes(config.to_json_string(use_diff=True).encode(), folder.child("config.json").url)
    return write_safetensors(weights, folder.child(WEIGHTS_FILE).url)


def write_timm(weights: Weights, dst: PathLike, arch: str, arch_args: dict[str, Any]) -> Location:
    """``dst/config.json`` written by timm for ``timm.create_model(arch, **arch_args)`` + ``dst/model.safetensors``."""
    import timm

    model = _build(lambda: timm.create_model(arch, pretrained=False, **arch_args), f"timm {arch}")
    check_fits(weights.state, model, f"timm.create_model({arch!r}, **{arch_args})")
    folder = Location.of(dst)
    if folder.is_url:
        raise CheckpointError("--format timm writes a local folder (timm writes its config.json itself).")
    folder.fs.makedirs(folder.path, exist_ok=True)
    timm_save_config_for_hf()(model, folder.child("config.json").path, model_args=arch_args)
    return write_safetensors(weights, folder.child(WEIGHTS_FILE).url)


def write_torchvision(weights: Weights, dst: PathLike, arch: str, arch_args: dict[str, Any]) -> Location:
    """A ``torch.save`` state dict, as torchvision's hub files are, fitting ``get_model(arch, **arch_args)``."""
    from torchvision.models import get_model

    model = _build(lambda: get_model(arch, weights=None, **arch_args), f"torchvision {arch}")
    check_fits(weights.state, model, f"torchvision.models.get_model({arch!r}, **{arch_args})")
    buffer = io.BytesIO()
    torch.save({k: v.contiguous() for k, v in weights.state.items()}, buffer)
    return write_bytes(buffer.getvalue(), dst)


def _build(factory: Any, what: str) -> nn.Module:
    try:
        with torch.device("meta"):
            return factory()
    except (AssertionError, RuntimeError, TypeError, ValueError, KeyError) as error:  # timm asserts on args
        raise CheckpointError(f"cannot build {what} ({error}); check --arch and --arch-args.") from error


def parse_arch_args(text: str | None) -> dict[str, Any]:
    """``--arch-args`` as a JSON object (``'{"embed_dim": 64, "depth": 4}'``)."""
    if not text:
        return {}
    try:
        args = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"--arch-args must be a JSON object, e.g. '{{\"depth\": 4}}': {error}") from error
    if not isinstance(args, dict):
        raise CheckpointError(f"--arch-args must be a JSON object, e.g. '{{\"depth\": 4}}'; got {text!r}.")
    return args
