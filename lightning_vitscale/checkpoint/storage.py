"""Where checkpoints live and how they are read safely: local paths or fsspec URLs, ``weights_only`` honoured.

Lightning saves to ``s3://``, ``gs://`` or ``memory://`` through fsspec, so a checkpoint location is an fsspec
filesystem plus a path. Reading follows torch's rule for ``weights_only``: ``None`` means torch's default
(``True`` unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set), so a crafted file cannot run code on load. DCP
itself unpickles its ``.metadata`` and its non-tensor values without restriction; the reader and planner here
apply the same rule to them.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import PurePath
from typing import IO, Any

import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from lightning_vitscale._compat import EmptyStateDictLoadPlanner, FsspecReader, FsspecWriter

DCP_METADATA = ".metadata"
# Written last into every sharded folder this package saves: what tells Lightning's loaders (checkpoint_loader.py)
# that a folder is ours, without unpickling anything; Lightning's own FSDP folders and others lack it.
SHARDED_MARKER = "lightning_vitscale.json"


def resolve_weights_only(weights_only: bool | None) -> bool:
    """``None`` -> torch's own default for ``torch.load`` (True, unless the user set the env override)."""
    if weights_only is not None:
        return weights_only
    return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in ("1", "y", "yes", "true")


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

    def makedirs(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def open(self, mode: str) -> IO[bytes]:
        return self.fs.open(self.path, mode)

    def writer(self) -> FileSystemWriter:
        return FsspecWriter(self.url) if self.is_url else FileSystemWriter(self.path)

    def reader(self, weights_only: bool | None) -> FileSystemReader:
        safe = resolve_weights_only(weights_only)
        reader = _SafeFsspecReader(self.url) if self.is_url else _SafeFileSystemReader(self.path)
        reader.weights_only = safe
        reader.location = self
        return reader


def torch_load(location: Location, weights_only: bool | None, mmap: bool = False) -> Any:
    """``torch.load`` of one file, local or remote; ``weights_only`` passed through to torch as given."""
    if mmap and not location.is_url:
        return torch.load(location.path, mmap=True, map_location="cpu", weights_only=weights_only)
    with location.open("rb") as f:
        return torch.load(f, map_location="cpu", weights_only=weights_only)


def write_sharded_marker(folder: Location) -> None:
    with folder.child(SHARDED_MARKER).open("wb") as f:
        f.write(json.dumps({"format": "lightning_vitscale sharded checkpoint", "version": 1}).encode())


def has_sharded_marker(folder: Location) -> bool:
    return folder.is_dir() and folder.child(SHARDED_MARKER).is_file()


def torch_save(obj: Any, location: Location) -> None:
    with location.open("wb") as f:
        torch.save(obj, f)


# What DCP's own `.metadata` pickle is made of; anything else (an os.system call, a user class) is refused.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib._local", "PosixPath"),  # Python >= 3.13
    ("pathlib._local", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Python's documented "restricting globals" unpickler (torch's weights-only unpickler does not read the
    protocol-5 frames DCP writes): only DCP metadata classes, torch dtypes and paths can be built."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of a DCP checkpoint's metadata;"
            " refusing to load it (weights_only). If you trust this checkpoint, pass weights_only=False"
            " (for the CLI: `python -m lightning_vitscale consolidate --unsafe ...`)."
        )


def read_dcp_metadata(stream: IO[bytes], weights_only: bool) -> dcp_metadata.Metadata:
    metadata = _MetadataUnpickler(stream).load() if weights_only else pickle.load(stream)
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP metadata.")
    return metadata


class _SafeMetadataMixin:
    weights_only: bool
    location: Location
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        with self.location.child(name).open("rb") as stream:
            metadata = read_dcp_metadata(stream, self.weights_only)
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    pass


class _SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    pass


class _SafeBytesMixin:
    """DCP stores every non-tensor value (param-group hyper-parameters, ...) with ``torch.save`` and loads it with
    ``weights_only=False``; load it under the caller's rule first, and hand DCP only a re-saved safe copy."""

    weights_only: bool

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self.weights_only:
            safe = io.BytesIO()
            torch.save(torch.load(value, weights_only=True), safe)
            safe.seek(0)
            value = safe
        super().load_bytes(read_item, value)  # type: ignore[misc]


class SafeLoadPlanner(_SafeBytesMixin, DefaultLoadPlanner):
    def __init__(self, weights_only: bool | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights_only = resolve_weights_only(weights_only)


class SafeEmptyLoadPlanner(_SafeBytesMixin, EmptyStateDictLoadPlanner):
    def __init__(self, weights_only: bool | None) -> None:
        super().__init__()
        self.weights_only = resolve_weights_only(weights_only)
