"""Block discovery: find the repeated transformer (or residual) blocks of any model without being told their class."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from torch import nn

from lightning_vitscale._compat import BatchNormBase, InstanceNormBase

if TYPE_CHECKING:
    from lightning_vitscale.policies import ModuleSelector

# Containers compare by structure, not class: two Sequentials are the same block only if they hold the same.
_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_composite(module: nn.Module) -> bool:
    """A block candidate has sub-modules with parameters: a lone Linear or LayerNorm is not worth its own unit."""
    return any(_num_params(child) > 0 for child in module.children())


def _signature(module: nn.Module) -> object:
    """What makes two siblings "the same block": their class, and for containers also what they contain."""
    if isinstance(module, _CONTAINERS):
        return (type(module), tuple(_signature(child) for child in module.children()))
    return type(module)


def _repeated_children(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """Direct children whose class occurs at least twice among the siblings and which hold parameters."""
    named = [(f"{prefix}{name}", child) for name, child in module.named_children()]
    counts = Counter(_signature(child) for _, child in named if _is_composite(child))
    return [(name, child) for name, child in named if _is_composite(child) and counts[_signature(child)] >= 2]


def _inner_blocks(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Repeated blocks strictly inside ``module`` that hold most of its parameters (a stage's blocks)."""
    found = list(_discover(module, f"{name}."))
    covered = sum(_num_params(m) for _, m in found)
    total = _num_params(module)
    return found if found and total and covered * 2 >= total else []


def _discover(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """Top-down walk; at each level take the repeated siblings, then prefer their own inner repetition.

    The innermost level wins when it carries most of the parameters: a Swin/MViT *stage* repeats, but its
    blocks are the unit the recipe wants (one block's parameters gathered at a time).
    """
    repeated = _repeated_children(module, prefix)
    repeated_ids = {id(m) for _, m in repeated}
    for name, child in repeated:
        inner = _inner_blocks(name, child)
        yield from inner if inner else [(name, child)]
    for name, child in module.named_children():
        if id(child) not in repeated_ids:
            yield from _discover(child, f"{prefix}{name}.")


def find_blocks(root: nn.Module, selector: ModuleSelector | None = None) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified_name, block)`` pairs in model order, outermost matches only.

    Args:
        root: the model to search.
        selector: ``None`` for automatic discovery, a set of block classes, or a predicate ``(name, module)``.
    """
    if selector is None:
        return _dedup(_discover(root, ""))
    predicate: Callable[[str, nn.Module], bool]
    if isinstance(selector, (set, frozenset)):
        classes = tuple(selector)

        def predicate(_: str, m: nn.Module) -> bool:
            return isinstance(m, classes)
    else:
        predicate = selector
    return _dedup(_select_outermost(root, "", predicate))


def _select_outermost(module: nn.Module, prefix: str, predicate) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if predicate(qualified, child):
            yield qualified, child
        else:
            yield from _select_outermost(child, f"{qualified}.", predicate)


def _dedup(pairs) -> list[tuple[str, nn.Module]]:
    """A module registered twice (shared weights) is one block."""
    seen: set[int] = set()
    out = []
    for name, module in pairs:
        if id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))
    return out


_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    BatchNormBase,
    InstanceNormBase,
)
_NORM_FUNCTIONS = frozenset({"layer_norm", "group_norm", "rms_norm", "batch_norm", "instance_norm"})
_NORM_NAME = re.compile(r"(Layer|Group|RMS|Rms|Batch|Instance)Norm")


def is_normalization(name: str, module: nn.Module) -> bool:
    """Normalization layers, including third-party ones that do not subclass torch's.

    A module counts if it is a torch norm, if its own ``forward`` calls a norm functional (``F.layer_norm``,
    ``F.group_norm``, ...), or if its class is named like one (HF/timm ``...RMSNorm``, ``LayerNorm2d``) — and
    it holds its parameters itself (a block that merely contains norms is not one).
    """
    if any(True for _ in (p for child in module.children() for p in child.parameters())):
        return False
    if isinstance(module, _NORM_TYPES):
        return True
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and _NORM_FUNCTIONS & set(code.co_names):
        return True
    return bool(_NORM_NAME.search(type(module).__name__))


def find_modules(root: nn.Module, predicate) -> list[tuple[str, nn.Module]]:
    """All modules (not just outermost) matching ``predicate(name, module)`` that hold parameters."""
    return [
        (name, module)
        for name, module in root.named_modules()
        if any(True for _ in module.parameters(recurse=False)) and predicate(name, module)
    ]


def describe_blocks(blocks: list[tuple[str, nn.Module]]) -> dict[str, int]:
    """Class name -> count, in first-seen order, for the setup summary."""
    counts: dict[str, int] = defaultdict(int)
    for _, module in blocks:
        counts[type(module).__name__] += 1
    return dict(counts)
