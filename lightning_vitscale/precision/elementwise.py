"""Which optimizers update each element from its own gradient and state alone, so that a step on local shards, or
on a flat tensor holding several parameters, is the step on the parameters themselves, element for element.

Updates reading several elements (Adafactor, LAMB, LBFGS) would be wrong there: only the exact classes in
:data:`ELEMENTWISE` qualify (a subclass may override ``step``). On one rank each local tensor is a whole parameter,
so there every optimizer but LBFGS steps the local tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
)


def is_elementwise(optimizer: object) -> bool:
    """Whether ``optimizer`` is one of the exact :data:`ELEMENTWISE` classes (its step may run on any split of its
    parameters: local shards, or one flat tensor holding several)."""
    return type(optimizer) in ELEMENTWISE


def steps_locally(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step may run on each DTensor parameter's local tensor: it is elementwise, or every
    local tensor is its whole parameter (one rank: any optimizer, Adafactor's factored rows and columns too, steps
    as on the plain model, where DTensor has no rule for some of their ops)."""
    if is_elementwise(optimizer):
        return True
    if isinstance(optimizer, torch.optim.LBFGS):
        return False  # its step calls the closure again: the plugin steps it itself (``local_step.lbfgs_...``)
    return holds_whole_parameters(optimizer)


def holds_whole_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether each DTensor parameter's local tensor is the whole parameter (one rank), or there is none."""
    # Called every step: the first DTensor's mesh is the run's (its norms' replicas and its shards share it).
    first = next((p for group in optimizer.param_groups for p in group["params"] if isinstance(p, DTensor)), None)
    return first is None or first.device_mesh.size() == 1


# torch's optimizers whose fused step takes ``found_inf`` (an attribute, as ``GradScaler`` sets it) and then leaves
# the weights and the state (step counters included) as they were where it is nonzero: checked on torch 2.11-2.14.
_SKIP_ON_DEVICE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every param group of ``optimizer`` steps fused, so a non-finite step can be skipped by the kernel
    itself (no host read of the decision); exact classes, as a subclass may override ``step``."""
    groups = optimizer.param_groups
    return (type(optimizer) in _SKIP_ON_DEVICE and bool(groups)
            and all(g.get("fused") and not g.get("differentiable") for g in groups))
