"""A unit's first gather is made outside inference mode (sharding/first_gathers.py): on one rank, FSDP2 as setup
leaves it (torch's FSDP2 alone, first called in inference mode, fails the training step after)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_vitscale._compat import initialize_fsdp_root
from lightning_vitscale.sharding.first_gathers import FirstGathers
from lightning_vitscale.sharding.fsdp import gathered_and_resharded
from lightning_vitscale.sharding.gather_checks import before_gather


def _sharded(mesh) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.Linear(8, 2))
    for index in (0, 2, 3):
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    initialize_fsdp_root(model)  # as setup does: a block unit called first stays a block unit
    return model, [m for m in model.modules() if isinstance(m, FSDPModule)]


def _hooks(units: list[nn.Module]) -> int:
    return sum(len(unit._forward_pre_hooks) for unit in units)


def test_torch_alone_fails_a_first_call_in_inference_mode_or_the_training_step_after(mesh):
    """The oracle: without the check, FSDP2's first gather in inference mode fails (here, in the call itself; on 2
    ranks, at the training step after it)."""
    model, _ = _sharded(mesh)
    with pytest.raises(RuntimeError, match="[Ii]nference tensor"):
        with torch.inference_mode():
            model(torch.randn(3, 4))
        model(torch.randn(3, 4)).sum().backward()


def test_a_first_call_in_inference_mode_leaves_the_model_trainable(mesh):
    model, units = _sharded(mesh)
    before = _hooks(units)
    FirstGathers(units, gathered_and_resharded)
    assert _hooks(units) == before + len(units)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        evaluated = model(x)
    assert evaluated.is_inference()
    assert _hooks(units) == before  # every unit gathered outside inference mode: the checks are gone
    model(x).sum().backward()  # trains
    with torch.inference_mode():
        assert torch.equal(model(x), evaluated)  # the same weights: nothing stepped


def test_units_first_called_outside_inference_mode_drop_their_checks_one_by_one(mesh):
    model, units = _sharded(mesh)
    before = _hooks(units)
    FirstGathers(units, gathered_and_resharded)
    model[0](torch.randn(3, 4))  # one block unit alone, outside inference mode
    assert _hooks(units) == before + len(units) - 1
    before_gather(model)  # the outer unit gathered for a call outside a step (outer_unit._gather), not inference
    assert _hooks(units) == before + len(units) - 2
    with torch.inference_mode():
        model(torch.randn(3, 4))  # the two units left are gathered outside inference mode first
    assert _hooks(units) == before
    model(torch.randn(3, 4)).sum().backward()
