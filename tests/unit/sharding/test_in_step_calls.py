"""The guard on calls of a block inside a step (``sharding/in_step_calls.py``), with the handshake stood in for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vitscale.distributed import collective_guard
from lightning_vitscale.sharding import in_step_calls
from lightning_vitscale.sharding.gather_checks import before_gather
from lightning_vitscale.sharding.in_step_calls import InStepCalls
from lightning_vitscale.sharding.outer_unit_errors import InStepCallError


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.fixture
def guarded(monkeypatch):
    """A model whose step calls are guarded; ``agreed``: each handshake made (``refuse``: the ones that fail)."""
    model, state = Model(), {"in_step": True, "agreed": [], "refuse": False}

    def agree(operation: int, count: int, check: int) -> None:
        assert operation == collective_guard.UNIT_CALL
        if state["refuse"]:
            raise collective_guard.NotJoinedError("not every rank made this call: rank 1 went on to a later step")
        state["agreed"].append((count, check))

    monkeypatch.setattr(collective_guard, "agree", agree)
    blocks = {f"blocks.{i}": block for i, block in enumerate(model.blocks)}
    calls = InStepCalls(model, blocks, lambda: state["in_step"])
    yield model, state, calls
    calls.remove()


def test_the_first_call_in_a_step_is_never_asked_and_a_count_agreed_once_stays_agreed(guarded):
    """A backbone run twice a step (every rank): its second calls agree in the first step only, until a new run."""
    model, state, calls = guarded
    x = torch.ones(1, 4)
    model(x)  # the outer unit's forward: a new step
    model.blocks(x)
    assert [count for count, _ in state["agreed"]] == [2, 2]  # each block's 2nd call, once
    assert state["agreed"][0][1] == collective_guard.fingerprint(["blocks.0"])
    for _ in range(3):  # later steps: the same calls, nothing asked
        model(x)
        model.blocks(x)
    assert len(state["agreed"]) == 2
    model(x)
    model.blocks(x)
    model.blocks[1](x)  # one call more than ever: asked again
    assert [count for count, _ in state["agreed"]] == [2, 2, 3]
    calls.new_run()  # a later Trainer's run: agreed afresh (mutation seen failing: new_run clearing only the calls)
    model(x)
    model.blocks[0](x)
    assert [count for count, _ in state["agreed"]] == [2, 2, 3, 2]


def test_a_call_not_every_rank_makes_raises_before_the_block_runs_naming_the_fix(guarded):
    model, state, _ = guarded
    ran: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda *_: ran.append(0))  # stands for FSDP2's gather
    model(torch.ones(1, 4))
    state["refuse"] = True
    with pytest.raises(InStepCallError) as raised:
        model.blocks(torch.ones(1, 4))  # the extra call, after the step's own
    assert ran == [0]  # the step's own call only: the refused one gathered nothing
    message = str(raised.value)
    assert message.startswith("Calling `blocks.0` a 2nd time in this step") and "rank 1 went on" in message
    assert "Make the same calls of the model in a step on every rank" in message
    state["refuse"] = False
    model.blocks(torch.ones(1, 4))  # a rank that caught it calls again: the same (2nd) call is asked
    assert [count for count, _ in state["agreed"]] == [2, 2]


def test_outside_a_step_and_inside_backward_nothing_is_counted(guarded, monkeypatch):
    """Outside a step the outer unit's own handshake guards a call; checkpointing's recompute runs in backward."""
    model, state, _ = guarded
    state["in_step"] = False
    for _ in range(3):
        model.blocks(torch.ones(1, 4))
    state["in_step"] = True
    monkeypatch.setattr(in_step_calls, "current_backward_id", lambda: 7)
    model.blocks(torch.ones(1, 4))
    model.blocks(torch.ones(1, 4))
    assert state["agreed"] == []


def test_a_gather_ahead_of_a_block_is_asked_for_the_call_to_come(guarded):
    """``fsdp.prefetch_on_entry`` gathers the first block as its container starts: the check comes before that
    gather, for the call to come, which then is not asked again (mutation seen failing: the distributed test's
    rank 1 timing out in its backward, rank 0's gather ahead paired with it)."""
    model, state, calls = guarded
    model(torch.ones(1, 4))
    before_gather(model.blocks[0])  # as the container's forward starts
    assert [count for count, _ in state["agreed"]] == [2]
    model.blocks[0](torch.ones(1, 4))
    assert [count for count, _ in state["agreed"]] == [2]
    state["refuse"] = True
    with pytest.raises(InStepCallError):
        before_gather(model.blocks[0])
    before_gather(nn.Linear(1, 1))  # not a guarded block: nothing to do
    calls.remove()
    before_gather(model.blocks[0])  # the guard removed: nothing asked
