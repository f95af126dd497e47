"""Modules nothing can shard, refused at setup before the planner measures anything, each naming the modules and
the fix (DDP trains some of them: where it does, the message says what to change)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_vitscale._utils import abbreviated


def refuse_unshardable_parameters(model: nn.Module) -> None:
    """Parameters nothing can shard, refused before the planner measures anything, naming them and the fix: a lazy
    module's (``nn.LazyLinear``: no shape until a forward; DDP refuses them at setup too), a TorchScript module's, an
    embedding's with sparse
    gradients (FSDP's reduce-scatter has no sparse kernel: the first backward raised torch's "Could not run
    'fsdp::chunk_cat' with arguments from the 'SparseCPU' backend"). 0-dim and complex ones, which FSDP2 refuses, are
    held replicated (``scalar_parameters.py``)."""
    named = list(model.named_parameters())
    lazy = [name for name, p in named if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"{type(model).__name__} has {len(lazy)} uninitialized parameter(s) ({abbreviated(lazy)}) of lazy modules"
            " (nn.LazyLinear and the like), which VitScaleStrategy cannot shard before they have a shape. Run the"
            " model once on a batch before `trainer.fit` (as DDP requires), or build those layers with their input"
            " size (e.g. nn.Linear(in_features, out_features))."
        )
    _refuse_scripted(model)
    sparse = [name for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(
            f"{type(model).__name__} has {len(sparse)} embedding(s) with sparse gradients ({abbreviated(sparse)}:"
            " `sparse=True`), which FSDP cannot reduce-scatter (DDP all-reduces them). Build them with"
            " `sparse=False` (the default): dense gradients, which AdamW and most optimizers need anyway."
        )


def _refuse_scripted(model: nn.Module) -> None:
    """TorchScript modules (``torch.jit.script(nn.Linear(...))``, deprecated in torch for ``torch.compile``): FSDP2 and
    the recipe act through module hooks, which they refuse (torch's "register_forward_pre_hook is not supported on
    ScriptModules", raised from inside setup), and torch's own non-reentrant checkpointing fails in one (an empty
    "operation failed in the TorchScript interpreter" in a checkpointed block's backward, a scripted GELU too)."""
    scripted = [name for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    outermost = [name for name in scripted if not any(name.startswith(f"{other}.") for other in scripted)]
    if outermost:
        raise ValueError(
            f"{type(model).__name__} holds {len(outermost)} TorchScript module(s) ({abbreviated(outermost)}:"
            " torch.jit.script or torch.jit.trace), which VitScaleStrategy cannot shard or checkpoint: FSDP2 and the"
            " recipe work through module hooks, which TorchScript modules refuse, and torch's activation"
            " checkpointing fails inside them. Keep those modules eager (drop torch.jit.script / torch.jit.trace);"
            " `VitScaleStrategy(kernels=\"auto\")` compiles the blocks with torch.compile instead."
        )
