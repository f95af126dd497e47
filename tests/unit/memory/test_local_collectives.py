"""A measured step's collectives stay on the rank (memory/local_collectives.py): the planner runs ``training_step``
on one rank while the others wait for its plan, so nothing it sends may reach them.

The world here is 2 ranks with one process: a recording backend stands in for gloo (it records each collective that
reaches it and completes it at once). Under the planner's fake modes nothing reaches it, and each collective leaves
the shapes (and, on fake tensors carrying real values, the values) a world of ranks holding this rank's data gives.
The world is made in a fresh process (this file run as a script), once for the module: the unit suite's processes
keep a world-size-1 default group for FSDP2 (tests/unit/conftest.py), and a process has one default group.
"""

from __future__ import annotations

import datetime
import json
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch.futures import Future

from lightning_vitscale.memory.fake_modes import carrying_real_values, fake_mode

SENT: list[str] = []


class _Recording(torch._C._distributed_c10d.Backend):
    """A backend, not a ProcessGroup: torch wraps it, so collectives reach it through the c10d ops, as gloo's do."""

    def _sent(self, name: str, value: object) -> object:
        SENT.append(name)
        future: Future = Future()
        future.set_result(value)
        return torch._C._distributed_c10d._create_work_from_future(future)

    def allreduce(self, tensors, opts=None):
        return self._sent("allreduce", tensors)

    def broadcast(self, tensors, opts=None):
        return self._sent("broadcast", tensors)

    def allgather(self, outputs, inputs, opts=None):
        return self._sent("allgather", outputs)

    def _allgather_base(self, output, input, opts=None):
        return self._sent("allgather_base", output)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._sent("reduce_scatter_base", output)

    def barrier(self, opts=None):
        return self._sent("barrier", None)

    def getBackendName(self) -> str:
        return "recording"


def _two_rank_world() -> None:
    dist.Backend.register_backend("recording", lambda store, rank, size, timeout: _Recording(rank, size),
                                  devices=["cpu"])
    dist.init_process_group("recording", store=dist.HashStore(), rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=10))


def _every_collective(x: torch.Tensor, objects: bool = True) -> dict[str, torch.Tensor | object]:
    """What a step's own collectives give: torch.distributed's (Lightning's strategy calls these) and functional.
    ``objects``: also an object broadcast, which fake tensors carrying real values cannot make (its
    ``torch.ByteTensor(storage)``: the planner then measures through ``forward``)."""
    gathered = [torch.empty(3) for _ in range(2)]
    into, scattered = torch.empty(6), torch.empty(3)
    dist.all_reduce(x)
    dist.barrier()
    dist.all_gather(gathered, x)
    dist.all_gather_into_tensor(into, x)
    dist.reduce_scatter_tensor(scattered, torch.arange(6.0))
    sent = [{"seed": 7}]
    if objects:
        dist.broadcast_object_list(sent)  # sent from this rank (the source): its list stands
    return {"all_reduce": x, "all_gather": torch.stack(gathered), "all_gather_into_tensor": into,
            "reduce_scatter_tensor": scattered, "broadcast_object_list": sent[0],
            "functional_all_reduce": functional.all_reduce(x, "sum", dist.group.WORLD),
            "functional_all_gather": functional.all_gather_tensor(x, 0, dist.group.WORLD)}


def _measured() -> dict:
    """In the fresh process: what reached the backend in each phase, and what each collective gave."""
    _two_rank_world()
    dist.all_reduce(torch.ones(3))
    dist.barrier()
    found: dict = {"sent_outside": list(SENT)}
    SENT.clear()
    with fake_mode(symbolic_items=True, values=None):
        out = _every_collective(torch.ones(3))
    found["sent_fake"] = list(SENT)
    found["shapes"] = {name: list(value.shape) for name, value in out.items() if isinstance(value, torch.Tensor)}
    found["object"] = out["broadcast_object_list"]
    with carrying_real_values(True), fake_mode(symbolic_items=True, values={}):
        out = _every_collective(torch.arange(3.0), objects=False)
        found["values"] = {name: value.real_tensor.tolist() for name, value in out.items()
                           if isinstance(value, torch.Tensor)}
    found["sent_real_values"] = list(SENT)
    dist.destroy_process_group()
    return found


@pytest.fixture(scope="module")
def measured() -> dict:
    from tests.helpers.launch import rank_env, run_bounded

    done = run_bounded([sys.executable, __file__], timeout=120, env=rank_env())
    assert done.returncode == 0 and not done.timed_out, done.output[-3000:]
    return json.loads(done.output.strip().splitlines()[-1])


def test_the_recording_backend_sees_collectives_sent_outside_the_planners_modes(measured):
    """The oracle: without the planner's modes, each collective reaches the backend."""
    assert measured["sent_outside"] == ["allreduce", "barrier"]


def test_on_fake_tensors_nothing_is_sent_and_shapes_are_a_worlds(measured):
    assert measured["sent_fake"] == []
    assert measured["shapes"] == {"all_reduce": [3], "all_gather": [2, 3], "all_gather_into_tensor": [6],
                                  "reduce_scatter_tensor": [3], "functional_all_reduce": [3],
                                  "functional_all_gather": [6]}
    assert measured["object"] == {"seed": 7}


def test_on_fake_tensors_carrying_real_values_the_values_are_this_ranks(measured):
    """A branch on a gathered value (the reason values are carried) reads this rank's data in every rank's slot."""
    assert measured["sent_real_values"] == []
    values, mine = measured["values"], [0.0, 1.0, 2.0]
    assert values["all_reduce"] == values["functional_all_reduce"] == mine
    assert values["all_gather"] == [mine, mine]
    assert values["all_gather_into_tensor"] == values["functional_all_gather"] == mine + mine
    assert values["reduce_scatter_tensor"] == mine  # rank 0's chunk of arange(6)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(json.dumps(_measured()))
