"""``fit(ckpt_path="last")`` and ``VitScaleStrategy(auto_resume=True)`` find the newest *complete* checkpoint, for
the strategy's launcher (``lightning/launcher.py``), before Lightning resolves the path. Incomplete candidates are
skipped with a log line saying why; when no copy of a saved ``last*.ckpt`` is complete, the newest other complete
checkpoint stands in, with a warning, never a silent start from scratch. The others become the load's fallbacks
should the chosen one fail its CRC-32 check, checked by all ranks together (each reads every ``world_size``-th
file), so a corrupt file fails on every rank alike (:func:`verified_checkpoint`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_vitscale._compat import checkpoint_dir
from lightning_vitscale.checkpoint.commit import newest_complete, target_of
from lightning_vitscale.checkpoint.manifest import damaged, file_problem, read_manifest
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER, Location
from lightning_vitscale.distributed.ranks import RankContext

CHECKPOINT_EXTENSION = ModelCheckpoint.FILE_EXTENSION


def complete_checkpoints(folder: Location, accept: Callable[[str], bool]) -> list[Location]:
    """The newest complete checkpoint of every name in ``folder`` that ``accept`` takes, newest save first."""
    if not folder.is_dir():
        return []
    targets = {target_of(folder.child(name)) for name in folder.names()}
    found = []
    for target in sorted((t for t in targets if accept(PurePath(t.path).name)), key=lambda t: t.url):
        newest, skipped = newest_complete(target)
        for line in skipped:
            rank_zero_info(f"lightning_vitscale resume: {line}")
        if newest is not None:
            found.append(newest)
    return sorted(found, key=saved_time, reverse=True)


def saved_time(location: Location) -> float:
    """When a checkpoint was completed: its marker's modification time, or a file's own."""
    marker = location.child(SHARDED_MARKER)
    stamped = marker if location.is_dir() and marker.exists() else location
    return float(stamped.fs.modified(stamped.path).timestamp())


def _is_last(callback: ModelCheckpoint, name: str) -> bool:
    last = callback.CHECKPOINT_NAME_LAST
    return name.endswith(CHECKPOINT_EXTENSION) and (name == last + CHECKPOINT_EXTENSION or name.startswith(f"{last}-"))


def last_path(trainer: Any) -> tuple[Location | None, list[Location]]:
    """``ckpt_path="last"``'s newest complete candidate (``OnExceptionCheckpoint``'s too) and the fallbacks."""
    last: list[Location] = []
    others: list[Location] = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            found, rest = last_with_fallbacks(callback, Location.of(checkpoint_dir(callback, trainer)))
            last, others = last + found, others + rest
    for callback in trainer.callbacks:
        if isinstance(callback, OnExceptionCheckpoint):
            newest, _ = newest_complete(Location.of(callback.ckpt_path))
            last += [newest] if newest is not None else []
    last.sort(key=saved_time, reverse=True)
    return (last[0] if last else None), last[1:] + sorted(others, key=saved_time, reverse=True)


def last_with_fallbacks(callback: ModelCheckpoint, folder: Location) -> tuple[list[Location], list[Location]]:
    """The complete ``last*.ckpt`` candidates of ``callback`` in ``folder`` and the other complete checkpoints."""
    last = complete_checkpoints(folder, functools.partial(_is_last, callback))
    others = complete_checkpoints(folder, lambda n: n.endswith(CHECKPOINT_EXTENSION) and not _is_last(callback, n))
    saved_last = any(_is_last(callback, PurePath(target_of(folder.child(n)).path).name) for n in folder.names())
    if not last and others and saved_last:
        rank_zero_warn(
            f"ckpt_path='last': no complete {callback.CHECKPOINT_NAME_LAST}{CHECKPOINT_EXTENSION} in {folder} (the"
            f" lines above say why); resuming from the newest complete checkpoint there instead: {others[0]}."
        )
        return others[:1], others[1:]
    return last, others


def auto_resume_path(trainer: Any) -> tuple[Location | None, list[Location]]:
    """The newest complete checkpoint in the ModelCheckpoint folders and the load's fallbacks, newest first."""
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if not callbacks or any(cb.dirpath is None for cb in callbacks):
        raise ValueError(
            "VitScaleStrategy(auto_resume=True) resumes from the newest complete checkpoint in the"
            " ModelCheckpoint folder, so it needs `ModelCheckpoint(dirpath=...)` among the Trainer's callbacks"
            " (the default folder changes with every logger version). Pass one, or drop auto_resume."
        )
    found: list[Location] = []
    for callback in callbacks:
        found += complete_checkpoints(Location.of(str(callback.dirpath)), lambda n: n.endswith(CHECKPOINT_EXTENSION))
    found.sort(key=saved_time, reverse=True)
    return (found[0] if found else None), found[1:]


def checksum_problem(folder: Location, group: RankContext) -> str | None:
    """The first CRC-32 mismatch in ``folder`` (``None``: none, or not a folder with a manifest); a collective."""
    manifest = read_manifest(folder) if folder.is_dir() else None
    listed = manifest["files"] if manifest else {}
    names = sorted(listed)[group.rank :: group.world_size]
    mine = [file_problem(folder, n, listed[n], listed[n]["size"], checksum=True) for n in names]
    found = sorted(p for share in group.all_gather_objects([p for p in mine if p]) for p in share)
    return found[0] if found else None


def verified_checkpoint(location: Location, fallbacks: list[Location], group: RankContext) -> Location:
    """``location``'s newest complete checkpoint, CRC-checked, else the first intact one of ``fallbacks``; a
    ``CheckpointError`` naming the corrupt file when none is left. No complete one at all: the loader says so."""
    candidates = [location, *(f for f in fallbacks if f != location)]
    for candidate in candidates:
        newest, skipped = newest_complete(candidate)
        for line in skipped:
            rank_zero_info(f"lightning_vitscale load: {line}")
        if newest is None:
            continue
        problem = checksum_problem(newest, group)
        if problem is None:
            if newest != location:
                rank_zero_info(f"lightning_vitscale load: loading {newest}, the newest complete checkpoint found")
            return newest
        if candidate is candidates[-1]:
            raise damaged(newest, problem)
        rank_zero_warn(f"lightning_vitscale load: skipped {newest}: {problem}")
    return location
