"""The row orders of a packed ``[q; k; v]`` projection under tensor parallelism: per-rank order and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_vitscale.row_layout import PACKED_ROWS, interleaved_rows, model_rows, packed_rows, reorder_packed
from lightning_vitscale.sharding.tensor_parallel import interleave_rows


@pytest.mark.parametrize(("parts", "ranks", "shape"), [(3, 2, (12, 5)), (3, 4, (24,)), (2, 3, (6, 2, 2))])
def test_model_rows_inverts_interleaved_rows(parts, ranks, shape):
    t = torch.randn(shape)
    per_rank = interleaved_rows(t, parts, ranks)
    assert not torch.equal(per_rank, t)
    assert torch.equal(model_rows(per_rank, parts, ranks), t)
    assert torch.equal(interleaved_rows(model_rows(t, parts, ranks), parts, ranks), t)


def test_interleaved_rows_puts_each_ranks_q_k_v_rows_together():
    rows = torch.arange(12.0)  # q = 0..3, k = 4..7, v = 8..11; 2 ranks
    assert interleaved_rows(rows, 3, 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    linear = nn.Linear(2, 12)
    expected = interleaved_rows(linear.weight.detach(), 3, 2)
    interleave_rows(linear, 3, 2)  # the in-place split tensor parallelism applies
    assert torch.equal(linear.weight.detach(), expected)


def test_reorder_packed_turns_listed_weights_and_their_optimizer_state_back():
    model = nn.Sequential(nn.Linear(2, 6), nn.Linear(6, 2))
    model[0].__dict__[PACKED_ROWS] = (3, 2)
    assert packed_rows(model) == {"0.weight": (3, 2), "0.bias": (3, 2)}
    w, b = torch.randn(6, 2), torch.randn(6)
    state = {"m.0.weight": interleaved_rows(w, 3, 2), "m.0.bias": interleaved_rows(b, 3, 2), "m.1.weight": w}
    reorder_packed(state, packed_rows(model), to_model=True, prefix="m.")
    assert torch.equal(state["m.0.weight"], w) and torch.equal(state["m.0.bias"], b) and state["m.1.weight"] is w
    optim = {"0.weight": {"exp_avg": w, "exp_avg_sq": w, "step": torch.tensor(3.0)}}
    reorder_packed(optim, packed_rows(model), to_model=False)
    assert torch.equal(optim["0.weight"]["exp_avg"], interleaved_rows(w, 3, 2))
    assert torch.equal(optim["0.weight"]["exp_avg_sq"], interleaved_rows(w, 3, 2))
    assert optim["0.weight"]["step"].item() == 3.0
