"""A sharded save SIGKILLed at every step of its protocol never loses the newest complete checkpoint.

Each save runs in a forked process that kills itself before its k-th filesystem step (writing shards, a file,
removing or moving a folder), or halfway through one (a folder half removed; a move as object stores do it, copy
then delete, stopped after the marker or after the whole copy). The parent then resolves ``ckpt_path="last"`` as a
run under the strategy does (its launcher) and reads what it found: the save before the crash or the crashed one,
never nothing. The next save (killed while writing its shards) must not destroy it either.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.checkpoint import CheckpointSettings, Location, load_consolidated
from lightning_vitscale.checkpoint.lightning.launcher import resolve_ckpt_path
from lightning_vitscale.checkpoint.save import save_checkpoint
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork and SIGKILL")


class Killer:
    """Counts the save's filesystem steps in the forked child and SIGKILLs it at step ``at``."""

    def __init__(self, at: int, shards_only: bool = False) -> None:
        self.at, self.step, self.shards_only = at, 0, shards_only
        self.write_data, self.remove = FileSystemWriter.write_data, Location.remove
        self.move_to, self.open = Location.move_to, Location.open

    def die_here(self, shards: bool = False) -> bool:
        """Kill the process if this is step ``at``; ``False`` otherwise. ``shards_only``: count shard writes only."""
        if self.shards_only and not shards:
            return False
        if self.step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.step += 1
        return False

    def hit(self) -> bool:
        """Whether this is step ``at``: the caller half does its step, then dies."""
        if self.shards_only:
            return False
        hit, self.step = self.step == self.at, self.step + 1
        return hit

    def killed_remove(self, location: Location) -> None:
        self.die_here()
        if location.is_dir() and len(location.names()) > 1 and self.hit():  # a folder half removed
            victim = location.child(sorted(location.names())[-1])
            victim.fs.rm(victim.path)
            os.kill(os.getpid(), signal.SIGKILL)
        self.remove(location)

    def killed_move(self, location: Location, dst: Location) -> None:
        self.die_here()
        if location.is_dir() and self.hit():  # an object store's copy, stopped after the marker
            dst.fs.makedirs(dst.path, exist_ok=True)
            if location.child(SHARDED_MARKER).exists():
                location.fs.copy(location.child(SHARDED_MARKER).path, dst.child(SHARDED_MARKER).path)
            os.kill(os.getpid(), signal.SIGKILL)
        if location.is_dir() and self.hit():  # ... after the whole copy, before the delete
            location.fs.copy(location.path, dst.path, recursive=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.move_to(location, dst)

    def install(self, patch: pytest.MonkeyPatch) -> None:
        write_data, open_ = self.write_data, self.open
        patch.setattr(FileSystemWriter, "write_data", lambda w, *a: self.die_here(True) or write_data(w, *a))
        patch.setattr(Location, "open", lambda loc, mode: ("w" in mode and self.die_here()) or open_(loc, mode))
        patch.setattr(Location, "remove", lambda loc: self.killed_remove(loc))
        patch.setattr(Location, "move_to", lambda loc, dst: self.killed_move(loc, dst))


def save(url: str, step: int) -> None:
    checkpoint = {"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}
    save_checkpoint(checkpoint, Location.of(url), CheckpointSettings(), lambda: None)


def save_killed_at(url: str, step: int, at: int, shards_only: bool = False) -> bool:
    """Save in a forked child killed at step ``at`` (``shards_only``: at its ``at``-th shard write); True when
    the kill happened (False: the save completed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            with pytest.MonkeyPatch.context() as patch:
                # The child saves alone: the session's world-size-1 process group (tests/unit/conftest.py) is the
                # parent's, its gloo threads are not forked, and torch 2.11's dcp.save would wait on them forever.
                patch.setattr(dist, "is_initialized", lambda: False)
                Killer(at, shards_only).install(patch)
                save(url, step)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def last_step(folder: Path) -> int | None:
    """``fit(ckpt_path="last")``'s choice under the strategy, and the step it holds."""
    trainer = Trainer(
        callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1, strategy=VitScaleStrategy(),
    )
    path = resolve_ckpt_path(trainer, "last", trainer.strategy.checkpoints)
    if path == "last":  # nothing found: Lightning's own resolution would start from scratch
        return None
    checkpoint = load_consolidated(path)
    assert torch.equal(checkpoint["state_dict"]["w"], torch.full((4,), float(checkpoint["global_step"])))
    return int(checkpoint["global_step"])


@pytest.mark.parametrize("scheme", ["local", "file-url"])
def test_a_save_killed_at_any_step_keeps_the_newest_complete_checkpoint(tmp_path, scheme, recwarn):
    results = {}
    for at in range(40):
        folder = tmp_path / f"kill-{at}"
        url = str(folder / "last.ckpt") if scheme == "local" else f"file://{folder}/last.ckpt"
        save(url, 1)
        if not save_killed_at(url, 2, at):
            break
        found = last_step(folder)
        assert found in (1, 2), f"killed at step {at}: ckpt_path='last' found {found} in {os.listdir(folder)}"
        # the next save, killed while writing its shards, must not destroy what the crash left
        assert save_killed_at(url, 3, 0, shards_only=True)
        assert last_step(folder) == found, f"killed at step {at}, then during the next save: {os.listdir(folder)}"
        save(url, 4)
        assert last_step(folder) == 4 and sorted(os.listdir(folder)) == ["last.ckpt"]
        results[at] = found
    assert 11 <= len(results) < 40 and set(results.values()) == {1, 2}, results
