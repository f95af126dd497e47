"""Tar shards streamed under ``Trainer.fit`` on 2 CPU ranks x 2 loader workers (vitscale), in one launch of
``scripts/streaming.py``: one epoch visits every sample once (the one padded sample twice, exactly the one the
rule names), both ranks run the same number of batches, a run resumed from a mid-epoch checkpoint takes exactly
the batches the first run took after it, and both examples' CLIs train from the shards (at a ``file://`` URL; the
built-in digits written once as shards).

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
TRAIN, SHARD, BATCH, SAVE_AT = 1437, 256, 64, 5  # the digits' training split as written: shards of 256


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out, work = tmp_path_factory.mktemp("streaming"), tmp_path_factory.mktemp("work")
    names = "epoch-resume,cli-classification,cli-pretraining"
    assert_ok(torchrun(SCRIPT, str(out), str(work), names, timeout=280))
    return load_ranks(out)


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
        assert run["saved"][0] == {"epoch": 0, "batches": SAVE_AT, "samples": SAVE_AT * BATCH, "ranks": 2,
                                   "workers": 2, "batch_size": BATCH, "epoch_samples": TRAIN}  # fmt: skip
        assert run["resumed"] == run["epoch"][SAVE_AT:]  # the same batches, in the same order


@pytest.mark.parametrize("example", ["classification", "pretraining"])
def test_examples_train_from_shards(ranks: list[dict], example: str) -> None:
    """``python examples/classification.py fit --data=ShardImageDataModule --data.root=URL`` and
    ``python examples/pretraining.py fit --data=ShardMultiCropDataModule`` (the built-in digits shards)."""
    for rank in ranks:
        run = rank[f"cli-{example}"]
        assert run["steps"] == 1 and run["in_chans"] == 1
        assert run["root"].startswith("file://") == (example == "classification")
