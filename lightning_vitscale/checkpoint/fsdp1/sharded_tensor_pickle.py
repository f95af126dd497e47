"""What the safe reader builds in place of a pickled ``ShardedTensor`` (FSDP1's ``LOCAL_STATE_DICT`` files): inert
records of its local shards. torch's own unpickling needs a process group of the saved world size, and its
weights-only unpickler refuses the classes and ``builtins.getattr`` the pickle uses: :class:`RecordUnpickler` maps
exactly those globals (by name, nothing imported) onto plain records; under ``weights_only`` it refuses the rest.
"""

from __future__ import annotations

import collections
import pickle
import types
from dataclasses import dataclass
from typing import Any

import torch

from lightning_vitscale._compat import get_layout, rebuild_from_type_v2, rebuild_tensor_v2
from lightning_vitscale.checkpoint.safe_reading import load_pickle, resolve_weights_only
from lightning_vitscale.checkpoint.storage import Location


class _Record:
    """An object the pickle fills in attribute by attribute (``BUILD``); it does nothing else."""

    def __setstate__(self, state: Any) -> None:
        # a ``(dict, slots)`` pair, a dict, or (TensorProperties) a plain tuple of values
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            for part in state:
                self.__dict__.update(part or {})
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state


class ShardedTensorRecord(_Record):
    ProcessGroupState: type = type("ProcessGroupState", (_Record,), {})


_SHARD = "torch.distributed._shard"
_RECORDS: dict[tuple[str, str], type] = {
    (f"{_SHARD}.sharded_tensor.api", "ShardedTensor"): ShardedTensorRecord,
    (f"{_SHARD}.sharded_tensor.shard", "Shard"): type("Shard", (_Record,), {}),
    (f"{_SHARD}.metadata", "ShardMetadata"): type("ShardMetadata", (_Record,), {}),
    (f"{_SHARD}.sharded_tensor.metadata", "ShardedTensorMetadata"): type("ShardedTensorMetadata", (_Record,), {}),
    (f"{_SHARD}.sharded_tensor.metadata", "TensorProperties"): type("TensorProperties", (_Record,), {}),
    (f"{_SHARD}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"): type("ChunkShardingSpec", (_Record,), {}),
    ("torch.distributed.remote_device", "_remote_device"): type("RemoteDevice", (_Record,), {}),
}


def _wrapper_subclass(cls: Any, dtype: Any, size: Any, *_: Any) -> tuple[Any, Any, Any]:
    """Stands in for ``torch._utils._rebuild_wrapper_subclass``: only remembers what it was asked to build."""
    return (cls, dtype, size)


def _from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """Stands in for ``torch._tensor._rebuild_from_type_v2``: a ``ShardedTensor`` becomes its record; a plain
    tensor with attributes (``torch.Tensor`` itself, as weights-only loading admits it) is rebuilt by torch."""
    if func is rebuild_tensor_v2 and new_type is torch.Tensor and isinstance(state, dict):
        return rebuild_from_type_v2(func, new_type, args, state)
    if func is not _wrapper_subclass or new_type is not ShardedTensorRecord or not isinstance(state, tuple):
        raise pickle.UnpicklingError("the file rebuilds a tensor subclass other than ShardedTensor; refusing it")
    record: Any = ShardedTensorRecord()  # untrusted data: its attributes are checked where they are read
    _, record.dtype, record.size = func(*args)
    record.local_shards, record.metadata, record.process_group = state[:3]
    return record


def _getattr(owner: Any, name: str) -> Any:
    if owner is ShardedTensorRecord and name == "ProcessGroupState":
        return ShardedTensorRecord.ProcessGroupState
    raise pickle.UnpicklingError(f"the file asks for getattr({owner!r}, {name!r}); refusing it")


_FUNCTIONS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type,
    ("builtins", "getattr"): _getattr,
    ("__builtin__", "getattr"): _getattr,
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
    ("torch.serialization", "_get_layout"): get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "device"): torch.device,
    (f"{_SHARD}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): int,  # the enum's value is all the record needs
}


def record_pickle_module(weights_only: bool) -> types.ModuleType:
    """A pickle module for ``torch.load`` building the records; ``weights_only``: every other global refused."""
    module = types.ModuleType("lightning_vitscale_record_pickle")

    class Unpickler(RecordUnpickler):
        restrict = weights_only

    module.Unpickler = Unpickler  # type: ignore[attr-defined]
    module.load = _refuse_legacy  # type: ignore[attr-defined]
    return module


def _refuse_legacy(*_: Any, **__: Any) -> Any:
    raise pickle.UnpicklingError("a pre-1.6 (non-zip) torch.save file: FSDP1 never wrote one")


class RecordUnpickler(pickle.Unpickler):
    restrict = True

    def find_class(self, module: str, name: str) -> Any:
        found = _RECORDS.get((module, name)) or _FUNCTIONS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if not self.restrict:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"Weights only load failed: the file refers to the global {module}.{name}, which is not part of an"
            " FSDP1 LOCAL_STATE_DICT file; refusing to load it (weights_only). If you trust this file, pass"
            " weights_only=False (CLI: `python -m lightning_vitscale consolidate --unsafe ...`)."
        )


@dataclass(frozen=True)
class LocalShards:
    """One rank's part of a flat parameter: its global size and its ``(offset, 1-D tensor)`` pieces."""

    numel: int
    dtype: torch.dtype
    pieces: tuple[tuple[int, torch.Tensor], ...]
    rank: int
    world_size: int
    group_size: int  # FSDP1's sharding group (the world, unless hybrid sharding): what its padding counts


def as_local_shards(record: Any, key: str) -> LocalShards:
    """The checked content of a record (1-D size, tensor shards, integer offsets), else not FSDP1's."""
    try:
        size = tuple(int(n) for n in record.size)
        pieces = tuple((int(s.metadata.shard_offsets[0]), s.tensor) for s in record.local_shards)
        group = record.process_group
        rank, world_size, group_size = int(group.global_rank), int(group.global_world_size), int(group.local_world_size)
        dtype = record.dtype
    except (AttributeError, TypeError, ValueError, IndexError) as error:
        raise pickle.UnpicklingError(f"{key} is a malformed ShardedTensor ({error})") from error
    if len(size) != 1 or not isinstance(dtype, torch.dtype) or not all(torch.is_tensor(t) for _, t in pieces):
        raise pickle.UnpicklingError(f"{key} is not a 1-D ShardedTensor of local tensors (an FSDP1 flat parameter)")
    return LocalShards(size[0], dtype, pieces, rank, world_size, group_size)


def load_local_shards(location: Location, weights_only: bool | None) -> Any:
    """One rank's FSDP1 ``LOCAL_STATE_DICT`` file, its ``ShardedTensor`` s as inert records (:class:`RecordUnpickler`
    under the ``weights_only`` rule; torch still reads the storages)."""
    return load_pickle(location, None, pickle_module=record_pickle_module(resolve_weights_only(weights_only)))
