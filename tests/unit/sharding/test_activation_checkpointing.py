"""Activation checkpointing checked by counting FLOPs on CPU: recompute shows up as extra forward FLOPs."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_vitscale.sharding.activation_checkpointing import apply_activation_checkpointing, is_checkpointed


def block() -> nn.Module:
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)


def train_flops(module: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        module(x).sum().backward()
    return counter.get_total_flops()


def test_backward_recomputes_the_forward():
    torch.manual_seed(0)
    plain, ckpt = block(), block()
    apply_activation_checkpointing([ckpt])
    x = torch.randn(2, 8, 32, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        plain(x)
    forward = counter.get_total_flops()
    assert train_flops(ckpt, x) - train_flops(plain, x) == forward


def test_dropout_masks_replay_exactly():
    torch.manual_seed(0)
    plain = block()
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing([ckpt])
    x = torch.randn(2, 8, 32)
    torch.manual_seed(1)
    plain(x).sum().backward()
    torch.manual_seed(1)
    ckpt(x).sum().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_applying_twice_is_a_no_op():
    m = block()
    apply_activation_checkpointing([m])
    first = m.forward
    apply_activation_checkpointing([m])
    assert m.forward is first and is_checkpointed(m)
