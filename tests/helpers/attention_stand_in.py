"""A CPU stand-in for xformers (which has CUDA kernels only), so attention routing is testable here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from lightning_vitscale.kernels import attention
from lightning_vitscale.kernels.attention import AttentionBackend


class CountingMath:
    """softmax(QK^T * scale)V by hand, counting its calls (eager only: a counter would not survive compile)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q, k, v, *, dropout_p=0.0, scale=None, is_causal=False):
        self.calls += 1
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if is_causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        return F.dropout(scores.softmax(-1), dropout_p) @ v


def stand_in(name: str = "math") -> AttentionBackend:
    return AttentionBackend(name, CountingMath(), lambda device: True)


@contextlib.contextmanager
def substituted(sdpa_ms: float, stand_in_ms: float) -> Iterator[AttentionBackend]:
    """Make the stand-in the only candidate and fix each kernel's measured time per call."""
    backend = stand_in()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "CANDIDATES", (backend,))
        ms = {F.scaled_dot_product_attention: sdpa_ms, backend.fn: stand_in_ms}
        patch.setattr(attention, "time_attention", lambda fn, call: ms[fn])
        yield backend
