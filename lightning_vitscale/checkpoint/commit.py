"""Committing a sharded save, and finding the newest complete checkpoint a crash left: no crash point loses one.

A save writes everything into ``<path>.partial``; its marker (``manifest.py``), written last, is the commit point.
Publishing then swaps the folder into ``<path>``: the old folder's marker goes first, then the rest of it, then
one move of the staging folder. At every instant one of ``<path>.partial`` and ``<path>`` is complete (a move on
an object store is copy + delete: the copy is complete before the source goes), so readers resolve a path to the
newer complete one of ``<path>.partial`` and ``<path>``, and the next save first finishes an interrupted publish
(:func:`recover`) before it clears the staging folder, so its own cleanup never deletes the only complete copy.
"""

from __future__ import annotations

from typing import Any

from lightning_vitscale.checkpoint.formats import PARTIAL_SUFFIX, partial_path
from lightning_vitscale.checkpoint.manifest import FileSum, why_incomplete, write_manifest
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER, Location


def commit(staging: Location, location: Location, files: dict[str, FileSum], saved: dict[str, Any]) -> None:
    """Run once (rank 0) after every rank wrote its shards and Lightning's metadata into ``staging``.

    ``files``: every file of ``staging`` with its size and CRC-32 (each rank hashes its own share). Writing the
    manifest commits the save; publishing moves it to ``location``. Whatever point a crash stops this at,
    :func:`newest_complete` finds this save or the previous one, and :func:`recover` finishes the publish.
    """
    write_manifest(staging, files, saved)
    publish(staging, location)


def publish(complete: Location, location: Location) -> None:
    """Replace ``location`` by the complete folder ``complete``: retire the old one marker first, then move."""
    retire(location)
    complete.move_to(location)


def retire(location: Location) -> None:
    """Remove a checkpoint so that no instant of the removal looks complete: a folder loses its marker first."""
    if location.is_dir():
        location.child(SHARDED_MARKER).remove()
    location.remove()


def candidates(location: Location) -> list[Location]:
    """Where the checkpoint saved to ``location`` can be, newest first: a staging folder is complete only once its
    save committed, after the folder it replaces."""
    return [partial_path(location), location]


def is_complete(location: Location, checksums: bool) -> str | None:
    """``None`` when ``location`` is a loadable checkpoint, else why not. Single files are Lightning's (DDP's,
    ``state_dict_type="full"``) and complete as its CheckpointIO wrote them; folders are checked by manifest."""
    if location.is_file():
        return None
    return why_incomplete(location, checksums)


def newest_complete(location: Location, checksums: bool = False) -> tuple[Location | None, list[str]]:
    """The newest complete checkpoint saved to ``location`` (itself, or what an interrupted save left), and one
    line per newer candidate skipped, saying why. ``checksums``: read every byte to check its CRC-32 too."""
    skipped: list[str] = []
    for candidate in candidates(location):
        if not candidate.exists():
            continue
        problem = is_complete(candidate, checksums)
        if problem is None:
            return candidate, skipped
        skipped.append(f"skipped {candidate}: {problem}")
    return None, skipped


def recover(location: Location) -> None:
    """Before a new save to ``location`` (rank 0): finish the publish a crash interrupted, then drop leftovers.

    Afterwards ``location`` holds the newest complete checkpoint if there is one, and no staging folder is left, so
    the new save may clear its staging folder without losing anything.
    """
    newest, _ = newest_complete(location)
    if newest is not None and newest != location:
        publish(newest, location)
    for leftover in candidates(location):
        if leftover != location:
            leftover.remove()


def target_of(location: Location) -> Location:
    """The path a staging folder was saved for (``last.ckpt.partial`` -> ``last.ckpt``)."""
    if not location.url.rstrip("/").endswith(PARTIAL_SUFFIX):
        return location
    cut = -len(PARTIAL_SUFFIX)
    return Location(location.fs, location.path.rstrip("/")[:cut], location.url.rstrip("/")[:cut])
