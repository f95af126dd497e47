"""Lightning callbacks whose work sharded parameters cannot hold, refused when a fit sets up (not where they act,
after an epoch of training).

``ModelPruning`` (``torch.nn.utils.prune``) ranks each weight's values whole and re-registers it as ``weight_orig``
times a ``weight_mask`` buffer; an FSDP2 unit's parameters are DTensor shards it manages by name, so the first
pruning, at the end of the first epoch, fails in DTensor ("Sharding propagation failed for aten.index.Tensor").
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning.pytorch.callbacks import Callback, ModelPruning


def refuse_unshardable_callbacks(callbacks: Iterable[Callback]) -> None:
    """Raise naming the callback and the fix where one rewrites parameters in a way sharding cannot follow."""
    for callback in callbacks:
        if isinstance(callback, ModelPruning):
            raise ValueError(
                "Lightning's ModelPruning callback re-registers each pruned weight as `weight_orig` times a mask, from"
                " the weight's values whole (torch.nn.utils.prune), which VitScaleStrategy's sharded parameters"
                " (DTensor shards, one FSDP unit managing each by name) cannot hold: it would fail at the end of the"
                " first epoch. Prune the trained model instead (`plain = copy.deepcopy(model)` on every rank after"
                " fit, or `lightning_vitscale.consolidated(path)`), or train with strategy=\"ddp\"."
            )
