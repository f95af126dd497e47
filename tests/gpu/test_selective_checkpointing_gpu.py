"""Selective checkpointing on CUDA: the fused attention kernels and bf16 matmuls are saved, not recomputed.

On CPU the tests see ``mm``/``addmm`` and the CPU flash kernel; a GPU routes SDPA to the flash / efficient /
cuDNN kernels, which must be in ``SAVED_OPS`` too, or selective checkpointing would recompute attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch.utils.flop_counter import FlopCounterMode

from lightning_vitscale.cli.demo import Block
from lightning_vitscale.sharding.activation_checkpointing import apply_activation_checkpointing

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _train_flops(block: torch.nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        block(x).float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_selective_recomputes_no_attention_or_matmul_on_cuda(dtype):
    torch.manual_seed(0)
    plain = Block(256, 8).to(CUDA, dtype)
    selective, full = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_activation_checkpointing([selective], "selective")
    apply_activation_checkpointing([full], "full")
    x = torch.randn(8, 256, 256, device=CUDA, dtype=dtype)
    with FlopCounterMode(display=False) as counter:
        plain(x)
    forward = counter.get_total_flops()
    base = _train_flops(plain, x)
    assert _train_flops(selective, x) == base
    # Full recompute reruns one forward, except that torch stops recomputing once every saved tensor backward
    # needs is back ("early stop"): this block's last matmul (the MLP's second linear, 2^30 FLOPs here) saves
    # nothing, so it is skipped. Without early stop the whole forward reruns.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        assert _train_flops(full, x) == base + forward
    for a, b in zip(plain.parameters(), selective.parameters()):
        torch.testing.assert_close(a.grad, b.grad)  # same kernels; flash backward may accumulate atomically
