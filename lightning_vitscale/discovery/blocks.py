"""Block discovery: find the repeated transformer (or residual) blocks of any model without being told their class,
each as the modules of it whose ``forward`` runs (a ``ModuleList`` of sub-layers iterated by its parent is never
called itself: its sub-layers are, and together they are one unit)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from torch import nn

from lightning_vitscale.discovery.unit_runs import in_call_order

ModuleSelector = set[type[nn.Module]] | frozenset[type[nn.Module]] | Callable[[str, nn.Module], bool]
"""Block classes, or a predicate on (qualified name, module)."""
Named = list[tuple[str, nn.Module]]
"""``(qualified name, module)`` pairs in model order."""
Unit = tuple[str, Named]
"""A found block's name and the modules of it that run (the block itself, or a container's sub-layers)."""

Ran = tuple[Collection[str], Mapping[str, str]]
"""What a measured step ran: the modules called, and which module's output each took (``Calls.fed``)."""

# Containers compare by structure, not class: two Sequentials are the same block only if they hold the same.
_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def holds_parameters(module: nn.Module, recurse: bool = True) -> bool:
    """Whether ``module`` (with its children, unless ``recurse=False``) has any parameter: nothing to shard else."""
    return any(True for _ in module.parameters(recurse=recurse))


def parameter_holder(model: nn.Module, name: str) -> str:
    """``name`` (a module of ``model``), or the closest module above it that holds parameters; ``""``: none but the
    model itself. Where an error raised in a layer is put down to the layer whose weights it computed with."""
    while name and not holds_parameters(model.get_submodule(name)):
        name = name.rpartition(".")[0]
    return name


def _is_composite(module: nn.Module) -> bool:
    """A block candidate has sub-modules with parameters: a lone Linear or LayerNorm is not worth its own unit."""
    return any(_num_params(child) > 0 for child in module.children())


def _is_layered(module: nn.Module) -> bool:
    """Two or more of ``module``'s sub-modules hold parameters: one convolution wrapped in a ``Sequential`` with its
    activation (FocalNet's focal layers) is a layer, no block of a layer stack."""
    holders = (m for m in module.modules() if m is not module and holds_parameters(m, recurse=False))
    return next(holders, None) is not None and next(holders, None) is not None


def _signature(module: nn.Module) -> object:
    """What makes two siblings "the same block": their class, and for containers also what they contain."""
    if isinstance(module, _CONTAINERS):
        return (type(module), tuple(_signature(child) for child in module.children()))
    return type(module)


def _repeated_children(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    named = [(f"{prefix}{name}", child) for name, child in module.named_children()]
    counts = Counter(_signature(child) for _, child in named if _is_composite(child))
    return [(name, child) for name, child in named if _is_composite(child) and counts[_signature(child)] >= 2]


def _inner_blocks(name: str, module: nn.Module, ran: Ran | None) -> list[tuple[str, nn.Module]]:
    """Repeated blocks strictly inside ``module`` that hold most of its parameters (a stage's blocks), or that
    form a layer stack (two whole networks side by side: DINO's student and teacher, a siamese pair); not where a
    measured step ran them side by side (an MoE layer's experts: the layer is the block). Repeated parts of one
    block (siblings of another kind beside them) are no blocks: the module they make is (MobileViT's block of
    convolutions around a transformer, inside a stage), or ``module`` itself where they make it."""
    found: list[tuple[str, nn.Module]] = []
    for inner, block in _discover(module, f"{name}.", ran):
        relative = inner[len(name) + 1:]
        if not _alike_siblings(module, relative, block) or _in_branches(module, relative):
            relative = _made_by(module, relative)
            if not relative:
                return []  # parts of ``module`` itself (an MBConv's convolutions): it is the block
            inner, block = f"{name}.{relative}", module.get_submodule(relative)
        found.append((inner, block))
    found = [(inner, block) for inner, block in _dedup(found)
             if not any(inner.startswith(f"{outer}.") for outer, _ in found)]
    if ran is not None and _side_by_side(found, ran):
        return []
    covered = sum(_num_params(m) for _, m in found)
    total = _num_params(module)
    if found and total and covered * 2 >= total:
        return found
    # A large head (DINO's prototypes) can outweigh a small backbone's blocks; the networks are still no blocks:
    # one of them as a unit would gather a whole model at once. Attribute siblings (a decoder layer's self- and
    # cross-attention) are no stack (a ModuleList/Sequential of two or more alike blocks): that layer stays the unit,
    # as does a block holding a stack of single layers (FocalNet's focal convolutions, 1% of the block).
    stacks = (m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)))
    layered = ([child for _, child in _repeated_children(m, "") if _is_layered(child)] for m in stacks)
    return found if any(len(children) >= 2 for children in layered) else []


def _alike_siblings(module: nn.Module, name: str, block: nn.Module) -> bool:
    """Whether every sibling of ``block`` (``module``'s sub-module ``name``) that holds parameters is one of its kind:
    a stage's blocks are (a ``Sequential`` of Swin blocks), the parts of one block are not (an MBConv's convolutions
    beside its squeeze-excitation or its last bare convolution, MaxViT's window and grid attention beside its MBConv,
    TNT's inner and outer attention and MLPs): those parts stay together, the block they make is the unit."""
    parent = module.get_submodule(name.rpartition(".")[0])
    siblings = [child for child in parent.children() if holds_parameters(child)]
    return {_signature(child) for child in siblings} == {_signature(block)} and not _widths_change(siblings)


def _in_branches(module: nn.Module, name: str) -> bool:
    """Whether a container above ``name`` (inside ``module``) is one of alike containers beside siblings of another
    kind: the branches of one block (GoogLeNet's Inception: two ``Sequential`` s of two convolutions beside a lone
    convolution and a pooling branch), whose parts are no blocks. A stage's container of blocks has no alike
    sibling (a Swin stage's ``blocks`` beside its ``downsample``)."""
    path = name.split(".")
    for depth in range(1, len(path)):
        container = ".".join(path[:depth])
        held = module.get_submodule(container)
        if not isinstance(held, _CONTAINERS):
            continue
        parent = module.get_submodule(container.rpartition(".")[0])
        alike = sum(1 for child in parent.children() if _signature(child) == _signature(held))
        if alike >= 2 and not _alike_siblings(module, container, held):
            return True
    return False


def _widths_change(siblings: list[nn.Module]) -> bool:
    """Three or more alike modules no two of which hold parameters of the same shapes: a bottleneck's convolutions
    (1x1 down, 3x3, 1x1 up: HF's ResNet), parts of one block. A stage's blocks after its first repeat exactly."""
    shapes = [tuple(tuple(p.shape) for p in child.parameters()) for child in siblings]
    return len(shapes) >= 3 and len(set(shapes)) == len(shapes)


def _made_by(module: nn.Module, part: str) -> str:
    """The module that ``part`` (a sub-module name of ``module``) is part of: its parent, or where that is a container
    (an MBConv's ``block`` Sequential) the closest module above it that is not; ``""``: ``module`` itself."""
    maker = part.rpartition(".")[0]
    while maker and isinstance(module.get_submodule(maker), _CONTAINERS):
        maker = maker.rpartition(".")[0]
    return maker


def _side_by_side(found: list[tuple[str, nn.Module]], ran: Ran) -> bool:
    """Whether the measured step ran two or more of ``found`` and none took another's output as its input: they are
    alternatives each handed its own input (an MoE layer's experts, each on the tokens routed to it), not a stack
    whose blocks feed each other (a Swin stage's, run in a chain)."""
    called, fed = ran
    names = {name for name, _ in found}
    run = [name for name in names if name in called]
    return len(run) >= 2 and not any(fed.get(name) in names for name in run)


def _discover(module: nn.Module, prefix: str, ran: Ran | None = None) -> Iterator[tuple[str, nn.Module]]:
    """Top-down walk: at each level the repeated siblings, or their own inner repetition when it carries most of
    the parameters (a Swin/MViT *stage* repeats, but its blocks are the unit the recipe wants)."""
    repeated = _repeated_children(module, prefix)
    repeated_ids = {id(m) for _, m in repeated}
    for name, child in repeated:
        inner = _inner_blocks(name, child, ran)
        yield from inner if inner else [(name, child)]
    for name, child in module.named_children():
        if id(child) not in repeated_ids:
            yield from _discover(child, f"{prefix}{name}.", ran)


def find_units(
    root: nn.Module, selector: ModuleSelector | None = None, called: Collection[str] | None = None,
    fed: Mapping[str, str] | None = None,
) -> list[Unit]:
    """The repeated blocks in model order, outermost matches only, each with the modules of it that run: the block
    itself when its ``forward`` runs, else its children's (recursively), which then share one unit. ``selector``:
    ``None`` discovers them. ``called``: the modules a training step ran (measured at setup), or ``None``: those
    whose class defines ``forward`` (``ModuleList``/``ModuleDict`` do not); a block none of whose modules ran: none.
    ``fed``: with ``called``, which module's output each took (``Calls.fed``): repeated modules run side by side
    inside a block are not blocks."""
    if selector is None:
        candidates = _discover(root, "", (called, fed) if called is not None and fed is not None else None)
    elif isinstance(selector, (set, frozenset)):
        classes = tuple(selector)
        candidates = _select_outermost(root, "", lambda _, m: isinstance(m, classes))
    else:
        candidates = _select_outermost(root, "", selector)
    units = ((name, _running(name, block, called)) for name, block in _dedup(candidates))
    return [(name, parts) for name, parts in units if parts]


def find_holding_units(
    root: nn.Module, selector: ModuleSelector | None = None, called: Collection[str] | None = None,
    fed: Mapping[str, str] | None = None, order: Sequence[str] = (),
) -> list[Unit]:
    """The units of :func:`find_units` as setup shards them and the planner measures them: each unit's modules that
    hold parameters, a unit left with none dropped; in the order a measured step called them (``order``: its blocks,
    in call order, :func:`~.unit_runs.in_call_order`), else in model order."""
    units = [(name, [(n, b) for n, b in parts if holds_parameters(b)]) for name, parts in
             find_units(root, selector, called, fed)]
    units = [(name, parts) for name, parts in units if parts]
    return [units[i] for i in in_call_order([[n for n, _ in parts] for _, parts in units], order)]


def find_blocks(
    root: nn.Module, selector: ModuleSelector | None = None, called: Collection[str] | None = None,
    fed: Mapping[str, str] | None = None,
) -> Named:
    """The modules of every unit of :func:`find_units`, in model order."""
    return [pair for _, parts in find_units(root, selector, called, fed) for pair in parts]


def _running(name: str, module: nn.Module, called: Collection[str] | None) -> Named:
    if type(module).forward is not nn.Module.forward and (called is None or name in called):
        return [(name, module)]
    return [pair for child, sub in module.named_children() if holds_parameters(sub)
            for pair in _running(f"{name}.{child}", sub, called)]


def _select_outermost(module: nn.Module, prefix: str, predicate) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if predicate(qualified, child):
            yield qualified, child
        else:
            yield from _select_outermost(child, f"{qualified}.", predicate)


def _dedup(pairs) -> list[tuple[str, nn.Module]]:
    """A module registered twice (shared weights) is one block."""
    first: dict[int, tuple[str, nn.Module]] = {}
    for name, module in pairs:
        first.setdefault(id(module), (name, module))
    return list(first.values())


def reused_modules(root: nn.Module, counts: Mapping[str, int]) -> list[tuple[str, nn.Module, int]]:
    """The outermost modules with parameters in their children that one call of ``root`` ran two or more times
    (``counts``: calls per qualified name, ``root`` as ``""``), each with its calls per call of ``root``. A block
    whose weights every layer shares (ALBERT's, a universal transformer's) is one module, so :func:`find_units`
    finds no repetition; named by the caller as the fix (``blocks={ItsClass}``), it becomes a unit checkpointed at
    each call."""
    per_run = max(counts.get("", 1), 1)
    found: list[tuple[str, nn.Module, int]] = []
    for name, module in root.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer, _, _ in found):
            continue
        times = counts.get(name, 0) // per_run
        if times >= 2 and _is_composite(module):
            found.append((name, module, times))
    return found


def find_modules(root: nn.Module, predicate: Callable[[str, nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """All modules (not just outermost) matching ``predicate(name, module)`` that hold parameters themselves."""
    return [
        (name, module)
        for name, module in root.named_modules()
        if holds_parameters(module, recurse=False) and predicate(name, module)
    ]


def outer_layers_of(model: nn.Module, blocks: Named, norm_modules: Named) -> Named:
    """Sub-modules with their own parameters that belong to no block and are no norm: the outer unit's layers, each
    of which takes its floating inputs in the compute dtype under O2 (as each block's unit does)."""
    inside = {id(m) for _, block in blocks for m in block.modules()} | {id(m) for _, m in norm_modules}
    outside = ((name, module) for name, module in model.named_modules() if name and id(module) not in inside)
    return [(name, module) for name, module in outside if any(True for _ in module.parameters(recurse=False))]


def describe_blocks(blocks: list[tuple[str, nn.Module]]) -> dict[str, int]:
    """Class name -> count, in first-seen order, for the setup summary."""
    return dict(Counter(type(module).__name__ for _, module in blocks))
