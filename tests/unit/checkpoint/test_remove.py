"""Removing a checkpoint waits for every rank before rank 0 deletes, and again before anyone goes on.

On gloo the caller's broadcast of the path already waits for every rank, so a multi-process test cannot see a
missing first barrier; NCCL's broadcast does not wait on the host. Here the barrier is a recorder: what existed
when each barrier was reached is the protocol.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_vitscale.checkpoint import Location
from lightning_vitscale.checkpoint.save import remove_checkpoint
from lightning_vitscale.distributed.ranks import RankContext


def _sharded_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "epoch=0.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"x")
    (folder / "__0_0.distcp").write_bytes(b"y" * 64)
    return folder


@pytest.mark.parametrize("rank_zero", [True, False])
def test_rank_zero_deletes_between_two_barriers(tmp_path: Path, rank_zero: bool):
    folder = _sharded_folder(tmp_path)
    seen: list[bool] = []  # at each barrier: does the checkpoint still exist?
    remove_checkpoint(
        Location.of(str(folder)), RankContext(rank=0 if rank_zero else 1, barrier=lambda: seen.append(folder.exists()))
    )
    # first barrier: other ranks may still read or write it, so it must still be there; the second: rank 0 is
    # done, so no rank goes on while it exists
    assert seen == ([True, False] if rank_zero else [True, True])
    assert folder.exists() is not rank_zero
