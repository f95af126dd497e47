"""Dropout under the default CUDA path: compiled, checkpointed blocks must recompute the masks they drew.

Activation checkpointing recomputes each block in backward; a recompute that draws fresh dropout masks gives
gradients of a different network (no error, just worse training). The oracle is eager kernels without
checkpointing. ``torch._inductor.config.fallback_random`` makes compiled code draw from torch's generator like
eager code does, so masks - and therefore losses and weights - can be compared across the two. A negative
control (recompute without restoring the RNG state) shows the comparison sees a wrong mask. The CPU twin on two
gloo ranks, against DDP: tests/distributed/test_compiled_dropout.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.strategy import VitScaleStrategy
from tests.helpers.models import largest_weight_difference, train_dropout_vit

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


COMPILED = KernelPolicy(compile_blocks=True, attention="auto", fused_optimizer=True)  # "auto" where it pays


def train(kernels: str, checkpointing: bool) -> dict:
    policy = COMPILED if kernels == "auto" else kernels
    return train_dropout_vit(VitScaleStrategy(kernels=policy, activation_checkpointing=checkpointing), "cuda")


def test_compiled_checkpointed_blocks_replay_dropout_masks(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fallback_random", True)
    oracle = train("eager", checkpointing=False)
    assert len(set(oracle["losses"])) > 1 and oracle["graphs"] == 0  # it trains, eagerly

    for kernels, checkpointing in (("eager", True), ("auto", True), ("auto", False)):
        run = train(kernels, checkpointing)
        assert run["checkpointed"] == (4 if checkpointing else 0)
        if kernels == "auto":  # the blocks really ran compiled code, in one piece
            assert run["graphs"] >= 1 and run["graph_breaks"] == 0, run
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(oracle["losses"]), rtol=1e-4, atol=1e-4)
        assert largest_weight_difference(run["weights"], oracle["weights"]) < 1e-3, (kernels, checkpointing)

    # Negative control: a recompute that draws new masks is caught by the same comparison.
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        functools.partial(torch.utils.checkpoint.checkpoint, preserve_rng_state=False))
    run = train("eager", checkpointing=True)
    assert largest_weight_difference(run["weights"], oracle["weights"]) > 1e-2
