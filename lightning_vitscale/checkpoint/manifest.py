"""The marker file of a sharded folder as its manifest: which files a complete save holds, their sizes and CRC-32s.

Written last (``commit.py``): a folder is complete exactly when its marker exists and every listed file is there
with its size. CRC-32 (``zlib``, ~1.4 GB/s on one core, benchmarks/RESULTS.md) catches storage corruption, not
tampering: the safe reader still guards against crafted pickles.
"""

from __future__ import annotations

import json
import zlib
from pathlib import PurePath
from typing import Any, NamedTuple

from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER, Location

FORMAT = "lightning_vitscale sharded checkpoint"
VERSION = 2
_CHUNK = 8 << 20  # zlib releases the GIL on large buffers; 8 MiB keeps memory flat on any shard size


class FileSum(NamedTuple):
    """One file of a sharded folder: its size in bytes and its CRC-32."""

    size: int
    crc32: int


def file_sum(location: Location) -> FileSum:
    crc, size = 0, 0
    with location.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return FileSum(size, crc)


def file_sums(folder: Location, names: list[str]) -> dict[str, FileSum]:
    return {name: file_sum(folder.child(name)) for name in names}


def write_manifest(folder: Location, files: dict[str, FileSum], saved: dict[str, Any]) -> None:
    listed = {name: {"size": s.size, "crc32": f"{s.crc32:08x}"} for name, s in sorted(files.items())}
    text = json.dumps({"format": FORMAT, "version": VERSION, **saved, "files": listed}, indent=1)
    with folder.child(SHARDED_MARKER).open("wb") as f:
        f.write(text.encode())


def read_manifest(folder: Location) -> dict[str, Any] | None:
    """The marker's content; ``None`` when missing or unreadable (a save that never committed)."""
    try:
        with folder.child(SHARDED_MARKER).open("rb") as f:
            manifest = json.loads(f.read().decode())
    except (OSError, ValueError):
        return None
    ours = isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
    return manifest if ours else None


def why_incomplete(folder: Location, checksums: bool) -> str | None:
    """``None`` for a complete folder, else what is wrong, naming the file (``checksums``: CRC-32s too)."""
    if not folder.is_dir():
        return "no such folder"
    manifest = read_manifest(folder)
    if manifest is None:
        return f"no readable {SHARDED_MARKER}: its save never completed"
    sizes = {PurePath(e["name"].rstrip("/")).name: e.get("size") for e in folder.fs.ls(folder.path, detail=True)}
    for name, expected in manifest["files"].items():
        problem = file_problem(folder, name, expected, sizes.get(name), checksums)
        if problem is not None:
            return problem
    return None


def file_problem(folder: Location, name: str, expected: dict[str, Any], size: int | None, checksum: bool) -> str | None:
    """What is wrong with one listed file (``size``: the filesystem's, ``None`` when missing)."""
    if size is None:
        return f"{folder.child(name)} is missing"
    if size != expected["size"]:
        return f"{folder.child(name)} has {size} bytes, its save wrote {expected['size']}"
    if checksum and f"{file_sum(folder.child(name)).crc32:08x}" != expected["crc32"]:
        return f"{folder.child(name)} fails its CRC-32 check (saved {expected['crc32']}): the file is corrupt"
    return None


def verify(folder: Location, required: bool = True) -> None:
    """Raise a ``CheckpointError`` naming the first missing, truncated or corrupt file of ``folder`` (every byte
    read: ~1.4 GB/s), or a folder without a manifest unless not ``required``."""
    if not required and read_manifest(folder) is None:
        return
    problem = why_incomplete(folder, checksums=True)
    if problem is not None:
        raise damaged(folder, problem, fix=(
            "Read another checkpoint of the run; only if you must use what is left, turn the check off:"
            " `--no-verify` (python -m lightning_vitscale export/consolidate) or `verify=False`."
        ))


def damaged(folder: Location, problem: str, fix: str = "") -> CheckpointError:
    fix = fix or "Resume from another checkpoint (ckpt_path='last' picks the newest complete one) or re-save it."
    return CheckpointError(f"Checkpoint {folder} is damaged: {problem}. {fix}")
