"""Tar shards streamed under ``Trainer.fit`` on 2 CPU ranks x 2 loader workers (vitscale), in one launch of
``scripts/streaming.py``: one epoch visits every sample once (the one padded sample twice, exactly the one the
rule names), both ranks run the same number of batches, a run resumed from a mid-epoch checkpoint takes exactly
the batches the first run took after it, and both examples' CLIs train from the shards (at a ``file://`` URL; the
built-in digits written once as shards).

Then, on the same 2 ranks and on 1, the end-of-epoch checkpoint resumes the next epoch with another number of
loader workers and batch size, and the mid-epoch one is refused under that layout.

Mutations seen failing: the resume position ignored (``ShardLoader.__iter__`` with ``skip = 0``: the resumed run
repeats the epoch's first batches); ranks not split (``rank=0`` in the datamodule's ``_loader``: both ranks read
the same half). The split over workers is checked sample by sample in test_shards.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from examples.models.shards import epoch_order
from tests.helpers.launch import assert_ok, torchrun
from tests.helpers.results import load_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/examples/scripts/streaming.py"
# the digits' training split as written: shards of 256
TRAIN, SHARD, BATCH, SAVE_AT, OTHER_BATCH = 1437, 256, 64, 5, 128


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """The 2-rank launch, then a 1-rank one resuming its checkpoints under another layout."""
    out, one, work = (tmp_path_factory.mktemp(name) for name in ("streaming", "one-rank", "work"))
    names = "epoch-resume,end-resume,cli-classification,cli-pretraining"
    assert_ok(torchrun(SCRIPT, str(out), str(work), names, timeout=280))
    assert_ok(torchrun(SCRIPT, str(one), str(work), "end-resume,mid-refused", nprocs=1, timeout=200))
    return load_ranks(out), load_ranks(one)


@pytest.fixture(scope="module")
def ranks(launches: tuple[list[dict], list[dict]]) -> list[dict]:
    return launches[0]


def test_one_epoch_visits_every_sample_once_and_pads_exactly_one(ranks: list[dict]) -> None:
    runs = [r["epoch-resume"] for r in ranks]
    per_rank = -(-TRAIN // 2)  # 719: the "pad" rule, DistributedSampler's
    for run in runs:  # equal steps: no rank waits at an uneven last batch
        assert len(run["epoch"]) == run["len"] == -(-per_rank // BATCH) == 12
        assert sum(map(len, run["epoch"])) == per_rank
    visits = Counter(key for run in runs for batch in run["epoch"] for key in batch)
    first = epoch_order(-(-TRAIN // SHARD), seed=0, epoch=0, shuffle=True)[0] * SHARD  # the epoch stream's first
    assert set(visits) == set(range(TRAIN))
    assert {k: n for k, n in visits.items() if n != 1} == {first: 2}


def test_resumed_epoch_takes_the_rest_exactly(ranks: list[dict]) -> None:
    for run in (r["epoch-resume"] for r in ranks):
        assert run["saved"][0] == {"epoch": 0, "batches": SAVE_AT, "samples": SAVE_AT * BATCH, "epoch_batches": 12,
                                   "ranks": 2, "workers": 2, "batch_size": BATCH, "epoch_samples": TRAIN}  # fmt: skip
        assert run["resumed"] == run["epoch"][SAVE_AT:]  # the same batches, in the same order


def test_an_end_of_epoch_checkpoint_resumes_under_another_layout_a_mid_epoch_one_is_refused(launches) -> None:
    """The next epoch, from the end-of-epoch checkpoint, with 1 loader worker instead of 2, batches of 128 instead
    of 64, on 2 ranks and on 1: every sample of epoch 1 once (the padded one twice on 2 ranks), from its start.
    The mid-epoch checkpoint under that layout is refused naming the flags (issue 49: both were refused)."""
    for ranks in launches:
        runs = [r["end-resume"] for r in ranks]
        per_rank = -(-TRAIN // len(runs))
        visits = Counter(key for run in runs for batch in run["epoch"] for key in batch)
        assert set(visits) == set(range(TRAIN)) and sum(visits.values()) == per_rank * len(runs)
        for run in runs:
            assert len(run["epoch"]) == run["len"] == -(-per_rank // OTHER_BATCH)
            assert run["step"] == 12 + run["len"]  # epoch 0's 12 steps, then all of epoch 1's
    refused = launches[1][0]["mid-refused"]["error"]
    assert refused is not None and "mid-epoch" in refused and "--data.num_workers, --data.batch_size" in refused


@pytest.mark.parametrize("example", ["classification", "pretraining"])
def test_examples_train_from_shards(ranks: list[dict], example: str) -> None:
    """``python examples/classification.py fit --data=ShardImageDataModule --data.root=URL`` and
    ``python examples/pretraining.py fit --data=ShardMultiCropDataModule`` (the built-in digits shards)."""
    for rank in ranks:
        run = rank[f"cli-{example}"]
        assert run["steps"] == 1 and run["in_chans"] == 1
        assert run["root"].startswith("file://") == (example == "classification")
