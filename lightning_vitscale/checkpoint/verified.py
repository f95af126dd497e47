"""Which checkpoint the strategy loads: the newest complete one saved to the path asked for, its CRC-32s checked
by all ranks together (each reads every ``world_size``-th file), so a corrupt file fails on every rank alike."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_vitscale.checkpoint.commit import newest_complete
from lightning_vitscale.checkpoint.manifest import damaged, file_problem, read_manifest
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.distributed.ranks import RankContext


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
