"""Blocks that ranks skip (LayerDrop): ``find_unused_parameters=True`` trains them, each in an FSDP unit, with the
losses and weights of DDP's ``ddp_find_unused_parameters_true``: ``True``, every block in the outer unit;
``"units"``, the blocks in units, a skipped block stood in for where it would have run (``sharding/stand_ins.py``);
without it, the rank that skipped raises ``SkippedBlocksError`` naming
the fix before its backward sends anything, and the job ends at once instead of waiting out the collective timeout
(it did: > 200 s, then gloo's "Connection closed by peer", naming nothing).

Mutation seen failing: units in the measured step's call order under ``find_unused_parameters``
(``ShardingPolicy.units_in_call_order`` always true): ``two_pass``'s step at setup skipped the first block in its
first pass, so it was listed last, and the stand-ins (which take the model's order) hung the launch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.launch import Finished, launch_ranks, lightning_launch
from tests.helpers.torch_features import needs_unused_parameter_reduction

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/distributed/scripts/skipped_blocks.py"
CONFIGS = ("per_rank", "same", "per_rank_accum2", "same_accum2", "uneven_bf16", "per_rank_units", "per_rank_speed",
           "accum2_units", "last", "first", "two_pass", "experts", "experts_units")
UNITS = ("per_rank_units", "per_rank_speed", "accum2_units", "last", "first", "two_pass")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    scenarios = ",".join(f"{config}/{strategy}" for config in CONFIGS for strategy in ("ddp", "vitscale"))
    return launch_ranks(tmp_path_factory, "skipped_blocks", SCRIPT, scenarios, timeout=240)[1]


@needs_unused_parameter_reduction
@pytest.mark.parametrize("config", CONFIGS)
def test_skipped_blocks_train_as_ddp_find_unused_parameters(runs, config):
    """fp32: DDP's losses on each rank and DDP's final weights. ``same`` skips block 3 on every rank at every step:
    its weights must stay as made (AdamW with weight decay would shrink them had it got zero gradients; seen:
    norm weights 32.0 -> 31.87 with a module-level count). bf16-mixed, rank 0 skipping a block rank 1 runs: the
    replicated fp32 norms reduce a zero gradient for the norms unused on rank 0; the losses are within bf16's
    resolution of DDP's AMP. Mutation seen failing: no zero-fill for the norms (their all-reduces differ in size).
    ``experts``: no flag, every block runs, the ranks pick different experts (and none picks the third): DDP's
    weights, the third expert only decayed (a zero gradient: DDP's flag leaves it none), which setup's summary says,
    naming the experts and the flag. Mutations seen failing: no zero-fill in the units (silently different weights
    from the second step: the reduce-scatters paired different experts of equal size); the note not added.
    """
    tolerance = 3e-2 if "bf16" in config else 1e-6
    for rank in runs:
        ours, ddp = rank[f"{config}/vitscale"], rank[f"{config}/ddp"]
        assert len(ours["losses"]) == len(ddp["losses"]) > 0
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=tolerance, abs=tolerance)
        if "bf16" not in config:  # AdamW's near-sign updates of tiny bf16 gradients: weights differ by ~lr anyway
            for name, value in ddp["weights"].items():
                if config.startswith("experts") and ".experts.2." in name:
                    # No rank uses it: DDP's flag leaves it no gradient; without ours it gets zeros, so AdamW
                    # only decays it, by (1 - lr * weight_decay) per step, 4 steps.
                    value *= (1 - 1e-2 * 0.1) ** 4
                assert ours["weights"][name] == pytest.approx(value, rel=1e-5, abs=1e-4), name
        if config.startswith("experts"):  # no flag: the experts unused on a rank are inside FSDP units
            assert ours["block_units"] == 4, ours["summary"]  # one grouped unit as it comes; four with "memory"
            # Said at setup: the experts rank 0's measured step left unused (the third, and one of the first two)
            assert ("16 trainable parameter(s) got no gradient in the step measured at setup"
                    " (blocks.0.experts.1.weight, blocks.0.experts.1.bias, blocks.0.experts.2.weight, ... +13)"
                    ) in ours["summary"]
            assert "VitScaleStrategy(find_unused_parameters=True) for DDP's behaviour" in ours["summary"]
            continue
        assert "got no gradient" not in ours["summary"]  # the flag set: DDP's behaviour, nothing to say
        if config in UNITS:  # each block in a unit, not the outer unit gathered for the whole step
            assert ours["block_units"] == 4, ours["summary"]
            assert "a block a rank skips (4 in units) is called as an identity" in ours["summary"]
            if config == "per_rank_speed":  # the planner's units, several blocks in one: stood in block by block
                assert "FSDP units          : 3 (4 blocks, up to 3 per unit + 1 outer)" in ours["summary"]
            continue
        assert ours["block_units"] == 0 and ours["stood_in"] is None  # True: a skipped block is in the outer unit
        # "same": block 3 never runs, so it is no block (the planner's trace finds what a step calls)
        blocks = 3 if config.startswith("same") else 4
        assert f"find_unused_parameters=True: the {blocks} blocks stay in the outer unit" in ours["summary"]
    # Every skip stood in for (4 steps; "last": rank 1 skips two blocks a step and the last in each evaluation).
    stood_in = {config: [rank[f"{config}/vitscale"]["stood_in"] for rank in runs] for config in UNITS}
    assert stood_in["per_rank_units"] == stood_in["per_rank_speed"] == [4, 4]
    assert stood_in["accum2_units"] == [8, 8]  # 2 micro-batches a step, each skipping its own block
    assert stood_in["last"] == [0, 4 * 2 + 2 * 2]  # 2 evaluations of 2 batches, the last block each
    assert stood_in["two_pass"] == [8, 11]  # rank 1: its first forwards' last block too (3 of 4 steps a second one)


@needs_unused_parameter_reduction
def test_skipped_blocks_in_evaluation_and_at_the_end_of_a_forward_keep_ddps_numbers(runs):
    """``last``: rank 1 skips the last block (and one more) in each training step and the last block in each
    evaluation, and logs with ``sync_dist=True`` in both: a late stand-in would have left rank 0 waiting in the
    last block's all-gather while rank 1 waits in the log's all-reduce (seen: the step hung). DDP's validation losses
    on each rank, DDP's training losses and weights (above). ``first``: the first block after a frozen stem (its
    input needs no gradient, so FSDP2 reduces its gradients at the end of backward) skipped by one rank a step."""
    for rank in runs:
        ours, ddp = rank["last/vitscale"], rank["last/ddp"]
        assert len(ours["val_losses"]) == 4
        assert ours["val_losses"] == pytest.approx(ddp["val_losses"], rel=1e-6, abs=1e-6)
        assert rank["first/vitscale"]["stood_in"] == 2


def test_a_block_one_rank_skips_fails_at_once_naming_the_fix(tmp_path):
    """Rank 1 skips a block rank 0 runs, with the default plan (one outer unit here) and with every block its own
    unit (``priority="memory"``, where rank 0 waits in a block's all-gather): Lightning's launcher, both end within
    seconds of start-up, rank 1's error names the cause and ``find_unused_parameters=True``."""

    def launch(priority: str) -> Finished:
        return lightning_launch(SCRIPT, str(tmp_path), "refuse", priority, timeout=150)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(launch, ("speed", "memory")))
    for result in results:
        assert not result.timed_out, result.output[-3000:]
        assert result.returncode != 0
        assert result.seconds < 90, f"took {result.seconds:.0f}s"
        assert "SkippedBlocksError: VitScaleStrategy: 1 of 4 blocks (blocks.1) did not run" in result.output
        assert "on rank 1 of 2" in result.output
        assert "VitScaleStrategy(find_unused_parameters=True)" in result.output
