"""Meta-device models get memory for their local shards only, then are initialised module by module."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

_INIT_METHODS = ("reset_parameters", "_reset_parameters")  # torch's MultiheadAttention only has the private one


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> list[str]:
    """Allocate (sharded) storage for meta tensors and run each module's own initialiser.

    Call after sharding: ``to_empty`` then allocates each rank's shard, never the full tensor. Tensors
    no initialiser covers are zero-filled (never left as uninitialised memory that may hold NaNs) and
    returned by name, so the caller can tell the user which modules need a ``reset_parameters()``.
    """
    if not has_meta_tensors(module):
        return []
    module.to_empty(device=device)
    uninitialised = []
    for name, submodule in module.named_modules():
        direct = [*submodule.named_parameters(recurse=False), *submodule.named_buffers(recurse=False)]
        if not direct:
            continue
        init = next((getattr(submodule, m) for m in _INIT_METHODS if callable(getattr(submodule, m, None))), None)
        if init is not None:
            init()
            continue
        for tensor_name, tensor in direct:
            tensor.zero_()
            uninitialised.append(f"{name}.{tensor_name}" if name else tensor_name)
    if uninitialised:
        rank_zero_warn(
            f"{len(uninitialised)} tensor(s) built on the meta device have no initialiser and were zero-filled:"
            f" {', '.join(uninitialised[:5])}{' ...' if len(uninitialised) > 5 else ''}. Give their module a"
            " `reset_parameters()` method to initialise them."
        )
    return uninitialised
