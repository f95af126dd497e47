"""Stand-ins for skipped blocks (``sharding/stand_ins.py``) on one process, without FSDP: which block is called as
an identity, when, on what, and that the step's values and gradients are the ones without stand-ins. The 2-rank
behaviour under FSDP2 (DDP's losses and weights, evaluation, a skipped last block, two forwards a step, a frozen
stem): ``tests/distributed/test_skipped_blocks.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_vitscale.sharding.stand_ins import (
    RepeatedBlockError,
    StandIns,
    finishing_forward,
    joining_on_loss,
    not_in_a_stack,
)


class Recorded(nn.Linear):
    """A block that records each call: ``"run"``, or ``"stand-in"`` when its forward was replaced."""

    def __init__(self, name: str, calls: list[tuple[str, str]]) -> None:
        super().__init__(4, 4)
        self.name, self.calls = name, calls
        self.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple) -> None:
        replaced = "forward" in self.__dict__
        self.calls.append((self.name, "stand-in" if replaced else "run"))


class Stack(nn.Module):
    """Four blocks; ``skip`` names those a forward leaves out; returns a dict with the loss, as a training_step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.calls: list[tuple[str, str]] = []
        self.blocks = nn.ModuleList(Recorded(f"b{i}", self.calls) for i in range(4))
        self.skip: set[int] = set()
        self.as_dict = True  # a training_step's two ways to return its loss

    def forward(self, x: torch.Tensor) -> Any:
        for index, block in enumerate(self.blocks):
            if index not in self.skip:
                x = block(x)
        loss = x.square().mean()
        return {"loss": loss} if self.as_dict else loss


def _stand_ins(model: Stack) -> StandIns:
    return StandIns([(f"blocks.{i}", block) for i, block in enumerate(model.blocks)], model)


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("as_dict", [True, False])
def test_a_skipped_block_is_stood_in_for_where_it_would_have_run_and_changes_no_number(as_dict):
    """Blocks 1 and 3 skipped: block 1 is called as an identity right before block 2 (where the others' gather of it
    pairs), block 3 when the call into the model ends, before its output is returned (joined behind the loss). The
    loss and every gradient are those of the same forward without stand-ins; the skipped blocks get none."""
    plain, model = Stack(), Stack()
    plain.skip = model.skip = {1, 3}
    plain.as_dict = model.as_dict = as_dict
    stand_ins = _stand_ins(model)
    x = torch.randn(2, 4)

    def loss_of(out: Any) -> torch.Tensor:
        return out["loss"] if as_dict else out

    expected = loss_of(plain(x))
    expected.backward()
    loss = loss_of(model(x))
    assert model.calls == [("b0", "run"), ("b1", "stand-in"), ("b2", "run"), ("b3", "stand-in")]
    assert stand_ins.stood_in == 2 and stand_ins.next == 0
    assert torch.equal(loss, expected)
    loss.backward()
    assert _gradients(model).keys() == _gradients(plain).keys() == {f"blocks.{i}.{p}" for i in (0, 2)
                                                                     for p in ("weight", "bias")}
    for name, grad in _gradients(plain).items():
        assert torch.equal(_gradients(model)[name], grad), name
    # The stand-ins were in the graph: their backward ran (FSDP2 reduces a stood-in unit's zeros there).
    reached: list[str] = []
    model.blocks[3].register_full_backward_hook(lambda *args: reached.append("b3"))
    model.calls.clear()
    loss_of(model(x)).backward()
    assert reached == ["b3"]


def test_a_second_forward_stands_in_for_the_first_ones_last_blocks_first():
    """Two forwards in one call into the model (a second crop): the first skipped its last block, the second its
    first. The second forward's first call stands in for block 3 (the first forward's) and block 0, in that order."""
    model = Stack()

    class TwoCrops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            model.skip = {3}
            first = model(x)["loss"]
            model.skip = {0}
            return first + model(x)["loss"]

    two = TwoCrops()
    StandIns([(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], two)  # the root: what the step calls
    two(torch.randn(2, 4)).backward()
    assert model.calls[:3] == [("b0", "run"), ("b1", "run"), ("b2", "run")]
    assert model.calls[3:6] == [("b3", "stand-in"), ("b0", "stand-in"), ("b1", "run")]


def test_the_forwards_end_is_stood_in_for_before_a_collective_sent_through_lightning():
    """``self.log(..., sync_dist=True)`` in the step runs the strategy's ``reduce`` before the call into the model
    ends: the last block's stand-in must come first (another rank waits in its gather). Lightning runs the reduce
    without gradients; the stand-in still joins the loss's graph. The strategy's backward joins what is left."""
    model = Stack()
    stand_ins = _stand_ins(model)
    order: list[str] = []

    class Strategy:
        sharded = type("Sharded", (), {"stand_ins": stand_ins})()
        reduce = finishing_forward(lambda self, value: order.append(f"reduce after {len(model.calls)} calls"))
        backward = joining_on_loss(lambda self, loss: loss)

    model.skip = {3}
    stand_ins._enter(model, ())  # inside the call into the model (a training_step)
    loss = model.blocks[2](model.blocks[1](model.blocks[0](torch.randn(2, 4)))).square().mean()
    with torch.no_grad():
        Strategy().reduce(loss)
    assert order == ["reduce after 4 calls"] and model.calls[-1] == ("b3", "stand-in")
    joined = Strategy().backward(loss)  # manual optimization: the backward inside the step
    assert joined is not loss and torch.equal(joined, loss) and stand_ins._pending == []
    joined.backward()


def test_evaluation_stands_in_when_the_call_ends_and_an_unfinished_forward_is_dropped():
    """Without gradients nothing is joined: the stand-in runs when the call into the model ends. A forward with
    gradients left without a backward (its graph dropped) is finished, without gradients, when the next call starts."""
    model = Stack()
    stand_ins = _stand_ins(model)
    model.skip = {2, 3}
    with torch.no_grad():
        out = model(torch.randn(2, 4))
    assert model.calls[-2:] == [("b2", "stand-in"), ("b3", "stand-in")] and not out["loss"].requires_grad
    model.calls.clear()
    model.skip = {3}
    stand_ins._enter(model, ())
    model.blocks[0](torch.randn(2, 4))  # a forward with gradients, abandoned after block 0
    stand_ins._depth = 0
    model.skip = set()
    model(torch.randn(2, 4))
    assert model.calls[:4] == [("b0", "run"), ("b1", "stand-in"), ("b2", "stand-in"), ("b3", "stand-in")]
    assert stand_ins._pending == []


def test_the_only_block_called_twice_in_one_forward_is_refused_naming_the_fix():
    """One block every layer shares: a rank that skips some of its calls cannot be stood in for."""
    shared = nn.Linear(4, 4)
    root = nn.Sequential(shared, shared)
    StandIns([("0", shared)], root)
    with pytest.raises(RepeatedBlockError, match=r"ran twice in one forward.*Leave it out of `blocks=`"):
        root(torch.randn(2, 4))


def test_blocks_held_alone_stay_out_of_the_units():
    """Conditional DETR's shape: two decoder layers in a ``ModuleList`` and two heads of one class held as plain
    attributes (``query_scale``, called before every layer but the first). The heads, found as repeated blocks, have
    no stack to be stood in by: ``"units"`` leaves them in the outer unit (they made the ranks' collectives differ in
    size before). Mutation seen failing: every block taken as in a stack."""

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.query_scale, self.ref_point_head = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))

    decoder = Decoder()
    blocks = [("layers.0", decoder.layers[0]), ("layers.1", decoder.layers[1]),
              ("query_scale", decoder.query_scale), ("ref_point_head", decoder.ref_point_head)]
    assert not_in_a_stack(blocks, decoder) == ["query_scale", "ref_point_head"]
    assert not_in_a_stack(blocks[:2], decoder) == []
