"""The one safe reader: every read of a checkpoint (files, DCP metadata, DCP values) honours ``weights_only``
(``None``: torch's default) and stays inside the checkpoint folder. DCP itself unpickles its ``.metadata`` and
non-tensor values unrestricted and reads any file its metadata names; the reader and planners here apply the rule
to every pickle and confine every file to the folder (``confinement.py``).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import ReadItem

from lightning_vitscale._compat import EmptyStateDictLoadPlanner, FsspecReader, StorageInfo, dcp_load_into, get_layout
from lightning_vitscale.checkpoint.confinement import check_storage, member
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.storage import DCP_METADATA, Location
from lightning_vitscale.row_layout import OwnLayoutLoadPlanner, PackedRows


def resolve_weights_only(weights_only: bool | None) -> bool:
    """``None`` -> torch's own default for ``torch.load`` (True, unless the user set the env override)."""
    if weights_only is not None:
        return weights_only
    return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in ("1", "y", "yes", "true")


# What DCP's own `.metadata` pickle is made of; anything else (an os.system call, a user class) is refused.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    (StorageInfo.__module__, StorageInfo.__name__),  # private torch classes DCP pickles: named by _compat
    (get_layout.__module__, get_layout.__name__),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
} | {(module, path) for module in ("pathlib", "pathlib._local") for path in ("PosixPath", "WindowsPath")}


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


class _SafeMetadataMixin:
    weights_only: bool
    location: Location
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        with member(self.location, name).open("rb") as stream:
            metadata = _MetadataUnpickler(stream).load() if self.weights_only else pickle.load(stream)
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP metadata.")
        check_storage(self.location, metadata.storage_data)  # before any collective: every rank reads it
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    pass


class _SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    pass


class _SafeBytesMixin:
    """DCP loads non-tensor values (param-group hyper-parameters) with ``weights_only=False``: load them under the
    caller's rule first and hand DCP a re-saved copy. Bytes where the caller has a tensor are refused (DCP would
    replace the tensor in its dict, leaving the caller's silently unloaded)."""

    state_dict: dict[str, Any]

    def __init__(self, weights_only: bool | None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weights_only = resolve_weights_only(weights_only)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if torch.is_tensor(self.state_dict.get(fqn)):
            raise CheckpointError(
                f"the checkpoint stores {fqn} as a pickled value, not as a tensor: it is crafted or was not written"
                " for this model; refusing to load it."
            )
        if self.weights_only:
            safe = io.BytesIO()
            torch.save(torch.load(value, weights_only=True), safe)
            safe.seek(0)
            value = safe
        super().load_bytes(read_item, value)  # type: ignore[misc]


class SafeLoadPlanner(_SafeBytesMixin, OwnLayoutLoadPlanner):
    pass


class SafeEmptyLoadPlanner(_SafeBytesMixin, EmptyStateDictLoadPlanner):
    pass


def safe_reader(location: Location, weights_only: bool | None) -> FileSystemReader:
    """DCP's storage reader, its ``.metadata`` unpickled under the ``weights_only`` rule, its files confined."""
    reader = _SafeFsspecReader(location.url) if location.is_url else _SafeFileSystemReader(location.path)
    reader.weights_only = resolve_weights_only(weights_only)
    reader.location = location
    return reader


def load_pickle(location: Location, weights_only: bool | None, mmap: bool = False, pickle_module: Any = None) -> Any:
    """``torch.load`` whose failure says whether the file is unreadable or holds objects weights_only refuses.
    ``pickle_module``: a restricted unpickler its caller built (``fsdp1/``), the only rule then (torch takes one only
    with ``weights_only=False``)."""
    rule: dict[str, Any] = {"weights_only": weights_only}
    if pickle_module is not None:
        rule = {"weights_only": False, "pickle_module": pickle_module}
    try:
        if mmap and not location.is_url:
            return torch.load(location.path, mmap=True, map_location="cpu", **rule)
        with location.open("rb") as f:
            return torch.load(f, map_location="cpu", **rule)
    except Exception as error:  # noqa: BLE001
        if pickle_module is not None and "refusing" in str(error):  # the restricted unpickler's own refusal
            raise CheckpointError(f"{location}: {error}") from error
        unsafe = _unsafe_globals(location) if pickle_module is None else []
        if unsafe:
            raise CheckpointError(
                f"{location} holds objects that loading with weights_only=True refuses ({', '.join(unsafe[:5])})."
                " Only if you trust this file: pass weights_only=False (e.g. trainer.fit(model, ckpt_path=...,"
                " weights_only=False)), or allow the classes with torch.serialization.add_safe_globals([...])."
            ) from error
        detail = f"{location} is not a readable checkpoint file (truncated or foreign?): {error}"
        raise CheckpointError(detail) from error


def load_safetensors(location: Location) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A ``.safetensors`` file's CPU tensors and string metadata (nothing to execute: no ``weights_only``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        with location.open("rb") as stream:
            data = stream.read()
        header = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header]).get("__metadata__") or {}
        return load(data), dict(metadata)
    except (SafetensorError, ValueError, OSError) as error:
        detail = f"{location} is not a readable safetensors file (truncated or foreign?): {error}"
        raise CheckpointError(detail) from error


def _unsafe_globals(location: Location) -> list[str]:
    """Names a weights-only load refuses in a readable file (empty for garbage); scans, never executes."""
    try:
        with location.open("rb") as stream:
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(stream))
    except Exception:  # noqa: BLE001 - not a torch.save zip file at all
        return []


def read_metadata(location: Location, weights_only: bool | None) -> dcp_metadata.Metadata:
    try:
        return safe_reader(location, weights_only).read_metadata()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - a refused or garbled pickle means the same thing to the user
        raise CheckpointError(f"{location} is not a readable checkpoint: {error}") from error


def load_into(
    state: dict[str, Any], location: Location, weights_only: bool | None, strict: bool = True,
    packed: PackedRows | None = None,
) -> None:
    """``dcp.load`` of ``state`` (a collective): tensors filled in place, other values replaced; ``strict=False``
    leaves keys the checkpoint lacks untouched."""
    planner = SafeLoadPlanner(weights_only, packed, allow_partial_load=not strict)
    with named_failures(location):
        dcp.load(state, storage_reader=safe_reader(location, weights_only), planner=planner)


def load_all(location: Location, weights_only: bool | None) -> dict[str, Any]:
    """Everything the folder's DCP shards hold, in one process with no process group (full CPU tensors)."""
    state: dict[str, Any] = {}
    reader = safe_reader(location, weights_only)
    with named_failures(location):
        dcp_load_into(state, storage_reader=reader, planner=SafeEmptyLoadPlanner(weights_only), no_dist=True)
    return state


def load_member(folder: Location, name: str, weights_only: bool | None) -> Any:
    return load_pickle(member(folder, name), weights_only)


@contextmanager
def named_failures(location: Location) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a ``BaseException``) as a ``CheckpointError`` naming path, cause and fix."""
    try:
        yield
    except CheckpointException as error:
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]
        own = next((cause for cause in causes if isinstance(cause, CheckpointError)), None)
        if own is not None:
            raise CheckpointError(str(own)) from error
        if any("Weights only load failed" in str(c) and "global" in str(c).lower() for c in causes):  # not garbled
            raise CheckpointError(
                f"{location} holds a value that loading with weights_only=True refuses: {error}. Only if you trust"
                " this checkpoint: pass weights_only=False (CLI: `python -m lightning_vitscale consolidate"
                " --unsafe`)."
            ) from error
        detail = "; ".join(f"{type(cause).__name__}: {cause}" for cause in causes[:2])
        raise CheckpointError(
            f"{location} could not be read (a shard corrupt or changed since the save?): {detail}"
        ) from error

