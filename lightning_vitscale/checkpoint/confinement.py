"""Every file a checkpoint folder names stays inside that folder, and is there and long enough before DCP reads:
DCP joins each ``relative_path`` of its ``.metadata`` to the folder as given (a crafted ``../../x`` or a symlink
out would read any file into a weight), and a missing or truncated shard fails as a bare ``CheckpointException``
not naming the file. Checked once, when every rank reads the metadata, before the first collective.
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from lightning_vitscale._compat import StorageInfo
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.storage import Location


def member(folder: Location, name: str) -> Location:
    """``folder/name``, refused unless inside ``folder`` (no absolute path, no ``..``, no symlink out)."""
    path = PurePosixPath(name)
    if not name or "\\" in name or path.is_absolute() or PureWindowsPath(name).drive or {"..", "."} & set(path.parts):
        raise CheckpointError(
            f"{folder} names the file {name!r}, which is not a plain path inside the checkpoint folder (absolute"
            " or with '..'): the checkpoint is crafted or corrupt; refusing to read outside the folder."
        )
    child = folder.child(name)
    if isinstance(folder.fs, LocalFileSystem):
        root = os.path.realpath(folder.path)
        if os.path.commonpath([root, os.path.realpath(child.path)]) != root:
            raise CheckpointError(
                f"{child} is a symlink to {os.path.realpath(child.path)}, outside the checkpoint folder {folder}:"
                " refusing to read outside the folder. Copy the file into the folder if you trust it."
            )
    return child


def check_storage(folder: Location, storage_data: Any) -> None:
    """Every file the storage table names is inside ``folder``, exists, and holds the bytes the table says."""
    if not isinstance(storage_data, dict):
        raise CheckpointError(f"{folder}: its DCP metadata has no storage table; the checkpoint is corrupt.")
    ends: dict[str, int] = {}
    for index, info in storage_data.items():
        stored = isinstance(info, StorageInfo) and isinstance(info.relative_path, str)
        if not (stored and _is_count(info.offset) and _is_count(info.length)):
            raise CheckpointError(f"{folder}: its DCP metadata stores {index} at {info!r}; the checkpoint is corrupt.")
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = member(folder, name)
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing: the checkpoint's metadata stores values in it. The folder is incomplete (a copy"
                " that stopped early?); copy it again, or resume from an earlier checkpoint."
            )
        size = int(file.fs.size(file.path))
        if size < end:
            raise CheckpointError(
                f"{file} is truncated: it has {size} bytes, the checkpoint's metadata stores values up to byte {end}."
                " Copy the folder again, or resume from an earlier checkpoint."
            )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
