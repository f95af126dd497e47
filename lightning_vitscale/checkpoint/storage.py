"""Where checkpoints live: local paths or fsspec URLs (``s3://``, ``gs://``, ``memory://``), as Lightning saves.
Reading goes through ``safe_reading.py`` only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import PurePath
from typing import IO

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemWriter

from lightning_vitscale._compat import FsspecWriter, keep_storage_data

DCP_METADATA = ".metadata"


# The manifest (manifest.py), written last: tells Lightning's loaders a folder is ours without unpickling anything.
SHARDED_MARKER = "lightning_vitscale.json"


@dataclass(frozen=True)
class Location:
    """A checkpoint path on a filesystem: plain local paths, or any fsspec URL (``s3://``, ``file://``, ...)."""

    fs: AbstractFileSystem
    path: str
    url: str

    @classmethod
    def of(cls, path: str | os.PathLike) -> Location:
        text = os.fspath(path)
        fs, inner = url_to_fs(text)
        return cls(fs, inner, text)

    @property
    def is_url(self) -> bool:
        return "://" in self.url

    def __str__(self) -> str:
        return self.url

    def child(self, name: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.url.rstrip('/')}/{name}")

    def with_suffix(self, suffix: str) -> Location:
        return Location(self.fs, self.path.rstrip("/") + suffix, self.url.rstrip("/") + suffix)

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def names(self) -> list[str]:
        return [PurePath(p).name for p in self.fs.ls(self.path, detail=False)] if self.is_dir() else []

    def remove(self) -> None:
        if self.exists():
            self.fs.rm(self.path, recursive=True)

    def move_to(self, dst: Location) -> None:
        self.fs.mv(self.path, dst.path, recursive=True)

    def open(self, mode: str) -> IO[bytes]:
        return self.fs.open(self.path, mode)

    def writer(self) -> FileSystemWriter:
        """DCP's writer; the ``Metadata`` its ``dcp.save`` returns lists the written files (``storage_data``) on
        every torch the package runs on (``_compat.keep_storage_data``)."""
        return keep_storage_data(FsspecWriter(self.url) if self.is_url else FileSystemWriter(self.path))

