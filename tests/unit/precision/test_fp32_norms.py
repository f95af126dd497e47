"""fp32 replicated norms: the parameter swap around a norm's forward survives a forward that raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale.precision.norms import ReplicatedNorms


class FlakyNorm(nn.LayerNorm):
    """A LayerNorm whose forward raises while ``fail`` is set (an OOM or a bad input in real life)."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("forward failed")
        return super().forward(x)


def test_a_forward_that_raises_leaves_the_dtensor_parameters_in_place(mesh):
    torch.manual_seed(0)
    norm = FlakyNorm(8)
    reference = nn.LayerNorm(8)
    reference.load_state_dict(norm.state_dict())
    ReplicatedNorms([norm], mesh, torch.float32)
    before = dict(norm._parameters)
    x = torch.randn(2, 8, dtype=torch.bfloat16)

    norm.fail = True
    with pytest.raises(RuntimeError, match="forward failed"):
        norm(x)
    assert all(norm._parameters[name] is param for name, param in before.items())  # not their local tensors
    assert all(isinstance(p, DTensor) for p in norm.parameters())

    norm.fail = False
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x.float()).to(torch.bfloat16))
    out.float().sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in norm.parameters())
