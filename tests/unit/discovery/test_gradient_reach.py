"""Which trainable parameters a loss reaches: read from its autograd graph, as DDP's ``find_unused_parameters``."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_vitscale.discovery.gradient_reach import parameters_without_gradient


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)  # uses out_proj's weight without calling it
        self.heads = nn.ModuleDict({"used": nn.Linear(8, 3), "unused": nn.Linear(8, 3)})
        self.frozen = nn.Linear(8, 3).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(()))  # used in the step's own arithmetic, not in a module's forward
        self.weighted = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.weighted(self.attention(x, x, x, need_weights=False)[0])
        return self.heads["used"](x).mean() * self.scale + self.frozen(x).mean()


def test_the_parameters_a_loss_does_not_reach_are_named_and_no_other():
    """out_proj (used by MultiheadAttention's functional call), the weight-normalized layer's originals and a scalar
    of the step are reached; the unused head is named; the frozen layer is not trainable, so not named. Mutation seen
    failing (torch 2.11): the visited nodes remembered by ``id`` alone (a freed node's id taken by the next one: every
    parameter named)."""
    model = Heads()
    loss = model(torch.randn(2, 4, 8))
    assert parameters_without_gradient(model, [loss]) == ("heads.unused.weight", "heads.unused.bias")
    loss.backward()  # the graph's answer is autograd's: what it leaves without a gradient
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == [
        "heads.unused.weight", "heads.unused.bias"]


def test_a_reentrant_checkpoint_hides_what_it_uses_so_nothing_is_said():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.randn(2, 4, requires_grad=True)
    hidden = checkpoint(model[0], x, use_reentrant=True)
    assert parameters_without_gradient(model, [model[1](hidden).sum()]) is None
    plain = checkpoint(model[0], x, use_reentrant=False)  # the non-reentrant one records the graph
    assert parameters_without_gradient(model, [model[1](plain).sum()]) == ()


def test_on_fake_tensors_as_the_planner_runs_the_step():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Heads()
        names = parameters_without_gradient(model, [model(torch.randn(2, 4, 8))])
    assert names == ("heads.unused.weight", "heads.unused.bias")
