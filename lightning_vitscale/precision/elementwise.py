"""Which optimizers update each element from its own gradient and state alone, so that a step on local shards, or
on a flat tensor holding several parameters, is the step on the parameters themselves, element for element.

Updates reading several elements (Adafactor, LAMB, LBFGS) would be wrong there: only the exact classes in
:data:`ELEMENTWISE` qualify (a subclass may override ``step``).
"""

from __future__ import annotations

import torch

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
)


def steps_locally(optimizer: object) -> bool:
    """Whether ``optimizer`` is one of the exact :data:`ELEMENTWISE` classes (its step may run on local shards)."""
    return type(optimizer) in ELEMENTWISE
