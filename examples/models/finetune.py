"""Fine-tuning from a run: its weights read back in, layer-wise learning-rate decay and a frozen backbone.

``load_pretrained`` reads a pretraining (or classification) run's sharded folder or ``.ckpt`` file, or a file
``python -m lightning_vitscale export`` wrote, through ``lightning_vitscale``'s safe reader (``read_weights``):
the trained weights, the ``ShardedEMA`` average or the DINO teacher (``key``). Which submodule of the run is the
backbone is found by name: the prefix under which the most of the network's own names appear (``net.`` in a
classification run, ``backbone.`` inside the DINO teacher); two equally good ones (a DINO run's student and
teacher) fail asking for ``module``. The classifier head is new (other classes): kept at its init.
"""

from __future__ import annotations

import re
from collections import Counter

from torch import nn

from examples.models.backbones import load_matching
from lightning_vitscale.checkpoint.export import WeightsChoice, read_weights

HEAD_NAMES = ("head", "heads", "classifier")  # the classifier's name in the built-in ViT, timm, torchvision, HF
_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers?|layer)\.(\d+)\.")  # ViT blocks: ours/timm, torchvision, HF


def load_pretrained(net: nn.Module, path: str, key: WeightsChoice = "model", module: str | None = None) -> None:
    """Load the backbone weights of ``path`` into ``net`` (its head excepted); fails naming what does not fit."""
    state = read_weights(path, weights=key, module=module or "").state
    names = set(net.state_dict())
    prefix = "" if module is not None else find_prefix(state, names, path, key)
    state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    head = {n for n in names - state.keys() if is_head(n)}
    load_matching(net, state, path, keep=head)


def find_prefix(state: dict[str, object], names: set[str], path: str, key: str) -> str:
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


def is_head(name: str) -> bool:
    return any(part in HEAD_NAMES for part in name.split(".")[:-1])


def freeze_backbone(net: nn.Module) -> None:
    """A linear probe: every parameter but the classifier head's stops taking gradients (and the optimizer,
    built from trainable parameters only, leaves it out)."""
    head = [p for n, p in net.named_parameters() if is_head(n)]
    if not head:
        raise ValueError(f"freeze_backbone: no parameter of {type(net).__name__} is under {HEAD_NAMES}: no head")
    net.requires_grad_(False)
    for p in head:
        p.requires_grad_(True)


def layer_decay_scale(names: list[str], decay: float) -> dict[str, float]:
    """Layer-wise learning-rate decay (BEiT, MAE fine-tuning): the head and final norm at scale 1, block ``i`` of
    ``L`` at ``decay ** (L - i)``, the patch and position embeddings at ``decay ** (L + 1)``."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"layer_decay {decay} must be in (0, 1]")
    ids = {n: int(m.group(1)) + 1 for n in names if (m := _BLOCK.search(n))}
    depth = max(ids.values(), default=0)
    stem = ("embed", "cls_token", "pos_embed", "embeddings")

    def layer(n: str) -> int:
        if n in ids:
            return ids[n]
        return 0 if any(s in n for s in stem) else depth + 1

    return {n: decay ** (depth + 1 - layer(n)) for n in names}
