"""Which trainable parameters a step's loss reaches through autograd: the others get no gradient from its backward.

Read from the autograd graph of the loss, as DDP's ``find_unused_parameters=True`` reads it (from the outputs to
every ``AccumulateGrad`` node), so a weight a module uses without calling the module owning it
(``nn.MultiheadAttention``'s ``out_proj``), a parametrized weight and a parameter used in the step's own arithmetic
count as reached. A graph holding a reentrant checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``) hides
the parameters inside it (its forward ran without autograd): nothing can be said, as DDP cannot either.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

_REENTRANT = "CheckpointFunctionBackward"


def parameters_without_gradient(model: nn.Module, outputs: Iterable[torch.Tensor]) -> tuple[str, ...] | None:
    """Names of ``model``'s parameters requiring grad that no path from ``outputs`` reaches (``()``: every one is);
    ``None`` where the graph cannot tell (a reentrant checkpoint in it)."""
    reached: set[int] = set()
    seen: dict[int, Any] = {}  # holds each node visited: a node's Python object is freed with its last reference,
    # and a later one could take its id (seen on torch 2.11: AccumulateGrad nodes taken for visited)
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ == _REENTRANT:
            return None
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return tuple(name for name, param in model.named_parameters() if param.requires_grad and id(param) not in reached)
