"""Committing a sharded save, and finding the newest complete checkpoint a crash left: no crash point loses one.

A save writes into ``<path>.partial``; its manifest, written last, commits it. Publishing retires ``<path>`` (marker
first) and moves the staging folder in: one of the two is always complete (an object store's move copies before
it deletes), readers take the newer complete one, and the next save first finishes an interrupted publish.
"""

from __future__ import annotations

from lightning_vitscale.checkpoint.formats import PARTIAL_SUFFIX, partial_path
from lightning_vitscale.checkpoint.manifest import why_incomplete
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER, Location


def publish(complete: Location, location: Location) -> None:
    retire(location)
    complete.move_to(location)


def retire(location: Location) -> None:
    """Remove a checkpoint so that no instant of the removal looks complete: a folder loses its marker first."""
    if location.is_dir():
        location.child(SHARDED_MARKER).remove()
    location.remove()


def candidates(location: Location) -> list[Location]:
    """Where the checkpoint saved to ``location`` can be, newest first."""
    return [partial_path(location), location]


def newest_complete(location: Location) -> tuple[Location | None, list[str]]:
    """The newest complete checkpoint saved to ``location`` and why each newer candidate was skipped. Files are
    complete as Lightning's CheckpointIO wrote them; folders by manifest (sizes, not CRC-32s)."""
    skipped: list[str] = []
    for candidate in candidates(location):
        if not candidate.exists():
            continue
        problem = None if candidate.is_file() else why_incomplete(candidate, checksums=False)
        if problem is None:
            return candidate, skipped
        skipped.append(f"skipped {candidate}: {problem}")
    return None, skipped


def recover(location: Location) -> None:
    """Before a new save to ``location`` (rank 0): finish a publish a crash interrupted, drop the leftovers."""
    newest, _ = newest_complete(location)
    if newest is not None and newest != location:
        publish(newest, location)
    partial_path(location).remove()  # the other candidate


def target_of(location: Location) -> Location:
    """The path a staging folder was saved for (``last.ckpt.partial`` -> ``last.ckpt``)."""
    if not location.url.rstrip("/").endswith(PARTIAL_SUFFIX):
        return location
    cut = -len(PARTIAL_SUFFIX)
    return Location(location.fs, location.path.rstrip("/")[:cut], location.url.rstrip("/")[:cut])
