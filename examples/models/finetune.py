"""Fine-tuning from a run: its weights read back in, layer-wise learning-rate decay and a frozen backbone.

``load_pretrained`` reads a pretraining (or classification) run's sharded folder or ``.ckpt`` file, or a file
``python -m lightning_vitscale export`` wrote, through ``lightning_vitscale``'s safe reader (``read_weights``):
the trained weights, the ``ShardedEMA`` average or the DINO teacher (``key``). Which submodule of the run is the
backbone is found by name: the prefix under which the most of the network's own names appear (``net.`` in a
classification run, ``backbone.`` inside the DINO teacher); two equally good ones (a DINO run's student and
teacher) fail asking for ``module``. The classifier head is new (other classes): kept at its init.

The detection example loads the same files into its ViTDet backbone (``load_pretrained(net.backbone, ...)``):
a network without class token or head, so the file's class token, its position and its head are left out, and
it trains its pyramid and heads on a frozen backbone (``freeze_backbone(net, ("pyramid", "head"))``).
``check_options`` fails at construction on what would fail later, with the same messages for both examples.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping

from torch import Tensor, nn

from examples.models.backbones import load_matching, require_weights
from examples.models.vit import DropPath
from lightning_vitscale.checkpoint.export import WeightsChoice, read_weights

HEAD_NAMES = ("head", "heads", "classifier")  # the classifier's name in the built-in ViT, timm, torchvision, HF
_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers?|layer)\.(\d+)\.")  # ViT blocks: ours/timm, torchvision, HF


def load_pretrained(net: nn.Module, path: str, key: WeightsChoice = "model", module: str | None = None) -> None:
    """Load the backbone weights of ``path`` into ``net`` (its head excepted); fails naming what does not fit."""
    state = read_weights(path, weights=key, module=module or "").state
    names = set(net.state_dict())
    prefix = "" if module is not None else find_prefix(state, names, path, key)
    state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if "cls_token" in state and "cls_token" not in names:  # a classifier's ViT into a dense backbone (ViTDet)
        state = without_class_token(state)
    head = {n for n in names - state.keys() if is_head(n)}
    load_matching(net, {k: v for k, v in state.items() if k in names or not is_head(k)}, path, keep=head)


def without_class_token(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ViT classifier's weights for a backbone without class token: the token and its position (the first of
    ``pos_embed``) left out; the grid's positions kept (another grid size keeps the backbone's init, as any
    other shape mismatch in ``load_matching``)."""
    state = {k: v for k, v in state.items() if k != "cls_token"}
    if "pos_embed" in state:
        state["pos_embed"] = state["pos_embed"][:, 1:]
    return state


def find_prefix(state: Mapping[str, object], names: set[str], path: str, key: str) -> str:
    """The prefix under which the most of ``names`` appear in ``state``; a tie fails asking for the module."""
    counts = Counter(k[: len(k) - len(n)] for k in state for n in names if k == n or k.endswith("." + n))
    if not counts:
        raise ValueError(
            f"{path} ({key} weights) holds none of this network's names (e.g. {sorted(names)[:3]}): is it a run of"
            " the same architecture? Name its submodule with --model.weights_module."
        )
    (best, hits), *rest = counts.most_common()
    ties = [p for p, h in rest if h == hits]
    if ties:
        options = ", ".join(repr(p.rstrip(".")) for p in [best, *ties])
        raise ValueError(
            f"{path} holds this network under several submodules ({options}, e.g. a DINO run's student and"
            f" teacher): pick one with --model.weights_module, or --model.weights_key=teacher."
        )
    return best


def is_head(name: str, heads: tuple[str, ...] = HEAD_NAMES) -> bool:
    return any(part in heads for part in name.split(".")[:-1])


def freeze_backbone(net: nn.Module, heads: tuple[str, ...] = HEAD_NAMES) -> None:
    """A linear probe: every parameter but those under ``heads`` (the classifier head; a detector's pyramid and
    heads) stops taking gradients (and the optimizer, built from trainable parameters only, leaves it out)."""
    head = [p for n, p in net.named_parameters() if is_head(n, heads)]
    if not head:
        raise ValueError(f"freeze_backbone: no parameter of {type(net).__name__} is under {heads}: no head")
    net.requires_grad_(False)
    for p in head:
        p.requires_grad_(True)


def layer_decay_scale(names: list[str], decay: float) -> dict[str, float]:
    """Layer-wise learning-rate decay (BEiT, MAE fine-tuning): the head and final norm at scale 1, block ``i`` of
    ``L`` at ``decay ** (L - i)``, the patch and position embeddings at ``decay ** (L + 1)``."""
    check_options(layer_decay=decay)
    ids = {n: int(m.group(1)) + 1 for n in names if (m := _BLOCK.search(n))}
    depth = max(ids.values(), default=0)
    stem = ("embed", "cls_token", "pos_embed", "embeddings")

    def layer(n: str) -> int:
        if n in ids:
            return ids[n]
        return 0 if any(s in n for s in stem) else depth + 1

    return {n: decay ** (depth + 1 - layer(n)) for n in names}


def layer_decay_lr_scale(module: nn.Module, decay: float | None) -> Callable[[str], float] | None:
    """``adamw_cosine``'s ``lr_scale`` for ``module``'s parameters (``layer_decay_scale``); ``None`` without decay."""
    if decay is None:
        return None
    return layer_decay_scale([n for n, _ in module.named_parameters()], decay).__getitem__


def check_options(
    weights: str | None = None,
    weights_key: str = "model",
    weights_module: str | None = None,
    layer_decay: float | None = None,
    drop_path: float = 0.0,
) -> None:
    """The fine-tuning options' checks, at construction: each failure names the option and what it takes."""
    require_weights(weights)
    if weights is None and (weights_key != "model" or weights_module is not None):
        raise ValueError(
            "--model.weights_key and --model.weights_module choose what --model.weights reads: give"
            " --model.weights=PATH (a run's checkpoint folder or .ckpt, or an exported file)."
        )
    if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
        raise ValueError(f"layer_decay {layer_decay} must be in (0, 1] (e.g. 0.65-0.75; leave it out for none)")
    DropPath(drop_path)  # a rate outside [0, 1) fails here, as it would when the network is built
