"""``distributed/empty_shards.py`` in one process: its max/min give torch's own result and layout wherever torch's
own runs (the handler replaces DTensor's for these ops, so it must equal it), and on a shard that is empty, the
reduction's identity combined under the same layout. Each rank's number against DDP's, on 2 ranks through
``Trainer.fit`` (a ``[1]`` parameter: rank 1's shard is empty): ``tests/distributed/test_dropin.py``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from lightning_vitscale._compat import dtensor_op_handlers
from lightning_vitscale.distributed.empty_shards import _EXTREMES, take_extremes_over_empty_shards

REDUCTIONS = {
    "max": lambda t: t.max(), "min": lambda t: t.min(), "amax": lambda t: t.amax(),
    "amax(0)": lambda t: t.amax(0), "amax(-1)": lambda t: t.amax(-1), "amin((0, 2))": lambda t: t.amin((0, 2)),
    "amax(1, keepdim)": lambda t: t.amax(1, keepdim=True),
    "amin(dim=0, keepdim)": lambda t: t.amin(dim=0, keepdim=True),
    "max of a sum": lambda t: (t.sum() * t).max(),
}


@pytest.fixture
def torch_own():
    """Run a reduction with torch's own DTensor handling of max/min, then put the package's back."""
    handlers = dtensor_op_handlers()

    def run(reduce, tensor):
        saved = {op: handlers.pop(op) for op in _EXTREMES if op in handlers}
        try:
            return reduce(tensor)
        finally:
            handlers.update(saved)

    return run


@pytest.mark.parametrize("sharded_dim", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_where_torch_runs_the_result_and_layout_are_torchs(mesh, torch_own, name, dtype, sharded_dim):
    take_extremes_over_empty_shards()
    whole = (torch.randn(4, 3, 5) * 10).to(dtype)
    sharded = distribute_tensor(whole, mesh, [Shard(sharded_dim)])
    ours, theirs = REDUCTIONS[name](sharded), torch_own(REDUCTIONS[name], sharded)
    assert isinstance(ours, DTensor) and ours.placements == theirs.placements
    assert ours.shape == theirs.shape and torch.equal(ours.full_tensor(), theirs.full_tensor())


@pytest.mark.parametrize(("name", "combine", "shape"), [
    ("max", "max", ()), ("min", "min", ()), ("amax(0)", "max", (3, 5)), ("amin(dim=0, keepdim)", "min", (1, 3, 5)),
])
def test_an_empty_shard_gives_the_identity_where_torch_raises(mesh, torch_own, name, combine, shape):
    """A rank whose shard of a ``[1, 3, 5]`` tensor is empty (made here on one rank: its local part empty): torch's
    own raises on it alone; the package's gives the identity, combined over the ranks as the other ranks' results."""
    take_extremes_over_empty_shards()
    empty = DTensor.from_local(torch.empty(0, 3, 5), mesh, [Shard(0)], run_check=False, shape=torch.Size([1, 3, 5]),
                               stride=(15, 5, 1))
    with pytest.raises((RuntimeError, IndexError), match="reduction dim"):
        torch_own(REDUCTIONS[name], empty)
    ours = REDUCTIONS[name](empty)
    identity = -float("inf") if combine == "max" else float("inf")
    assert ours.placements == (Partial(combine),) and tuple(ours.to_local().shape) == shape
    assert torch.all(ours.to_local() == identity)
