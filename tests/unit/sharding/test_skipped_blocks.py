"""What counts as a block having run, and the settings of ``find_unused_parameters`` (the 2-rank behaviour:
``tests/distributed/test_skipped_blocks.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.sharding.settings import EVERY_BLOCK, ShardingPolicy
from lightning_vitscale.sharding.skipped_blocks import ForwardMarks, SkippedBlockCheck, SkippedBlocksError


def test_only_a_training_forward_marks_a_block():
    """Evaluation (no gradients) and checkpointing's recompute in backward call the block too; neither may count,
    or a block skipped in the step would pass because it ran in the previous backward's recompute."""
    block = nn.Linear(4, 4)
    marks = ForwardMarks([("block", block)])
    x = torch.randn(2, 4, requires_grad=True)
    with torch.no_grad():
        block(x)
    assert marks.take() == [False]
    checkpoint(block, x, use_reentrant=False).sum().backward()  # the recompute calls the block during backward
    assert marks.take() == [True]  # the forward's call, once; take() starts afresh
    assert marks.take() == [False]


def test_a_reentrant_checkpoints_forward_marks_its_block():
    """``checkpoint(block, x, use_reentrant=True)`` in a model's forward runs the block with gradients off, then again
    in backward: a training forward (DDP trains it), where a no-grad call on the same input is not."""
    block = nn.Linear(4, 4)
    marks = ForwardMarks([("block", block)])
    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=True)
    assert marks.take() == [True]
    out.sum().backward()  # the recompute
    assert marks.take() == [False]
    checkpoint(block, x.detach(), use_reentrant=True)  # no input needs a gradient: the block gets none (nor in DDP)
    assert marks.take() == [False]


def test_every_block_of_a_reentrant_checkpoint_sequential_segment_is_marked():
    """``checkpoint_sequential(blocks, 2, x)``: inside a segment only the first block's input requires a gradient
    (the next ones are computed without); every block of it trains in the recompute."""
    blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    marks = ForwardMarks([(str(i), block) for i, block in enumerate(blocks)])
    checkpoint_sequential(blocks, 2, torch.randn(2, 4, requires_grad=True), use_reentrant=True).sum().backward()
    assert marks.take() == [True] * 4


def test_the_check_names_the_skipped_blocks_and_ignores_frozen_ones():
    blocks = [(f"blocks.{i}", nn.Linear(4, 4)) for i in range(3)]
    blocks[2][1].requires_grad_(False)  # not trained: its skipping sends nothing
    check = SkippedBlockCheck(blocks, rank=1, world_size=2)
    x = torch.randn(2, 4)
    blocks[0][1](x)
    with pytest.raises(SkippedBlocksError, match=r"1 of 3 blocks \(blocks\.1\) did not run .* on rank 1 of 2") as info:
        check.before_backward()
    assert "VitScaleStrategy(find_unused_parameters=True)" in str(info.value)
    for _, block in blocks:
        block(x)
    check.before_backward()  # every block ran: nothing raised
    blocks[1][1](x)
    check.reset()  # a training step starts: a call from a callback before it does not count
    with pytest.raises(SkippedBlocksError, match=r"blocks\.0, blocks\.1\)"):
        check.before_backward()


def test_find_unused_parameters_settings_are_checked():
    with pytest.raises(ValueError, match="find_unused_parameters=True` is not supported with tensor_parallel > 1"):
        ShardingPolicy(find_unused_parameters=True, tensor_parallel=2)
    with pytest.raises(ValueError, match="find_unused_parameters='yes'` must be True, False or 'units'"):
        VitScaleStrategy(find_unused_parameters="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keeps every block in the outer unit, so `blocks_per_unit=2`.*'units'"):
        VitScaleStrategy(find_unused_parameters=True, blocks_per_unit=2)
    with pytest.raises(ValueError, match="`reshard_after_forward=True` cannot apply"):
        VitScaleStrategy(find_unused_parameters=True, reshard_after_forward=True)
    # What the planner, the traffic report and the summary read: one unit of every block, kept gathered.
    sharding = VitScaleStrategy(find_unused_parameters=True).config.sharding
    assert sharding.find_unused_parameters and sharding.blocks_per_unit == EVERY_BLOCK
    assert sharding.reshard_after_forward is False and not sharding.stands_in
    # "units": the blocks stay the units the planner (or the user) chooses, a skipped one stood in for.
    units = VitScaleStrategy(find_unused_parameters="units", blocks_per_unit=2, reshard_after_forward=True)
    assert units.config.sharding.stands_in and units.config.sharding.blocks_per_unit == 2
    with pytest.raises(ValueError, match="is not supported with tensor_parallel > 1"):
        ShardingPolicy(find_unused_parameters="units", tensor_parallel=2)
