"""``accumulation=``: when micro-batches may keep unsharded gradients, and the FSDP2 switch that does it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.memory import choose_accumulation
from lightning_vitscale.sharding.gradient_sync import gradient_sync_off, unsharded_gradient_bytes

MIB = 2**20


def test_auto_keeps_unsharded_gradients_only_where_they_fit():
    fits = choose_accumulation("auto", extra_bytes=10 * MIB, in_use=80 * MIB, budget=90 * MIB)
    assert fits.unsharded and "one reduce-scatter per optimizer step" in fits.describe()
    tight = choose_accumulation("auto", extra_bytes=11 * MIB, in_use=80 * MIB, budget=90 * MIB)
    assert not tight.unsharded and "does not fit" in tight.describe()
    assert choose_accumulation("unsharded", 10**12, 0, 1).unsharded
    assert not choose_accumulation("sharded", 0, 0, 10**12).unsharded


def test_unknown_accumulation_mode_fails_at_construction():
    with pytest.raises(ValueError, match="`accumulation='never'` is not supported"):
        VitScaleStrategy(accumulation="never")  # type: ignore[arg-type]


def test_gradient_sync_off_switches_every_unit_and_back(mesh):
    from torch.distributed.fsdp import fully_shard

    from lightning_vitscale._compat import fsdp_param_groups

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def syncing() -> list[bool]:
        return [group.reduce_grads for m in model.modules() for group in fsdp_param_groups(m)]

    assert syncing() == [True, True]  # the root holds no parameters of its own: no group
    with gradient_sync_off(model):
        assert syncing() == [False, False]
    assert syncing() == [True, True]
    assert unsharded_gradient_bytes(model, torch.bfloat16) == (4 * 4 + 4 + 4 * 2 + 2) * 2
