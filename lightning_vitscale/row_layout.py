"""Tensor parallelism's row layout of packed projections, in one place.

A packed ``[q; k; v]`` projection split by tensor parallelism holds its rows rank after rank, each rank's slice of
every part (:func:`interleaved_rows`), as do its optimizer state and EMA. Every full view (``state_dict()``, full
checkpoints, ``consolidate``) is in the model's own order (:func:`reorder_packed`), and DCP writes and reads each
rank's chunk as ranges of the model's rows (:func:`model_row_pieces`): a folder loads under any other layout.
Below ``init``, ``sharding``, ``averaging`` and ``checkpoint``; imports only ``_utils``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from lightning_vitscale._utils import strip_wrapper_prefixes

# A Linear split so carries ``(parts, ranks)`` under this attribute (``sharding/tensor_parallel.py`` sets it).
PACKED_ROWS = "_vitscale_packed_rows"
PackedRows = dict[str, tuple[int, int]]  # {parameter name: (parts, ranks)}: :func:`packed_rows`


def interleaved_rows(tensor: torch.Tensor, parts: int, ranks: int) -> torch.Tensor:
    """``[p_0 | p_1 | ...]`` (``parts`` blocks of rows) -> each rank's slice of every part, rank after rank."""
    rest = tensor.shape[1:]
    return tensor.reshape(parts, ranks, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def model_rows(tensor: torch.Tensor, parts: int, ranks: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_rows`."""
    return interleaved_rows(tensor, ranks, parts)


class RowPiece(NamedTuple):
    """Rows ``local..local + length`` of a rank's chunk are rows ``model..model + length`` in the model's order."""

    local: int
    model: int
    length: int


def model_row_pieces(start: int, length: int, rows: int, parts: int, ranks: int) -> list[RowPiece]:
    """Rows ``[start, start + length)`` of a packed projection in per-rank order as contiguous ranges of the
    model's own order: split only where a rank's slice of a part ends (contiguous in both orders), adjacent ranges
    merged, so one rank's chunk is at most ``parts`` ranges."""
    if parts < 1 or ranks < 1 or rows % (parts * ranks):
        raise ValueError(f"{rows} packed rows do not split into {parts} parts over {ranks} ranks")
    if start < 0 or length < 0 or start + length > rows:
        raise ValueError(f"rows [{start}, {start + length}) are outside a projection of {rows} rows")
    slice_rows, part_rows = rows // (parts * ranks), rows // parts
    pieces: list[RowPiece] = []
    row, end = start, start + length
    while row < end:
        block = row // slice_rows  # the block of one rank's slice of one part, in per-rank order
        rank, part = divmod(block, parts)
        stop = min(end, (block + 1) * slice_rows)
        model = part * part_rows + rank * slice_rows + row - block * slice_rows
        last = pieces[-1] if pieces else None
        if last is not None and last.model + last.length == model:
            pieces[-1] = RowPiece(last.local, last.model, last.length + stop - row)
        else:
            pieces.append(RowPiece(row - start, model, stop - row))
        row = stop
    return pieces


def packed_rows(module: torch.nn.Module) -> PackedRows:
    """``(parts, ranks)`` of every packed projection in ``module``, by parameter name (wrapper prefixes stripped)."""
    found: PackedRows = {}
    for name, sub in module.named_modules():
        spec = sub.__dict__.get(PACKED_ROWS)
        if spec is not None:
            for param, _ in sub.named_parameters(recurse=False):
                found[strip_wrapper_prefixes(f"{name}.{param}" if name else param)] = spec
    return found


def reorder_packed(tensors: dict[str, Any], packed: PackedRows, to_model: bool, prefix: str = "") -> None:
    """In place: each full tensor (or optimizer state dict of them) that ``packed`` lists under ``prefix`` + name,
    into the model's own row order (``to_model``) or into per-rank order."""
    reorder = model_rows if to_model else interleaved_rows
    for key, value in tensors.items():
        spec = packed.get(strip_wrapper_prefixes(key[len(prefix):])) if key.startswith(prefix) else None
        if spec is None:
            continue
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            tensors[key] = reorder(value, *spec)
        elif isinstance(value, dict):
            states = [v for v in value.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            shape = max(states, key=torch.Tensor.numel).shape if states else None  # the parameter's (not `step`)
            tensors[key] = {k: reorder(v, *spec) if isinstance(v, torch.Tensor) and v.shape == shape else v
                            for k, v in value.items()}


Piece = tuple[RowPiece, ChunkStorageMetadata]


def packed_spec(path: tuple[Any, ...], packed: PackedRows) -> tuple[int, int] | None:
    """``(parts, ranks)`` when DCP's flattened ``path`` names a packed parameter, its optimizer state or EMA."""
    for key in path[1:]:
        if isinstance(key, str):
            spec = packed.get(strip_wrapper_prefixes(key))
            if spec is not None:
                return spec
    return None


def _pieces(state_dict: dict[str, Any], mappings: dict[str, Any], packed: PackedRows, fqn: str) -> list[Piece] | None:
    """This rank's chunk of a packed ``DTensor`` as (local rows, chunk in the model's order); ``None`` otherwise."""
    value = state_dict.get(fqn)
    if not packed or not isinstance(value, DTensor) or value.dim() == 0:
        return None
    spec = packed_spec(tuple(mappings.get(fqn, (fqn,))), packed)
    if spec is None:
        return None
    (chunk,) = value.__create_chunk_list__()  # DCP's own: this rank's offsets and sizes in the global tensor
    rest_offsets, rest_sizes = tuple(chunk.offsets[1:]), tuple(chunk.sizes[1:])
    return [
        (piece, ChunkStorageMetadata(torch.Size((piece.model, *rest_offsets)), torch.Size((piece.length, *rest_sizes))))
        for piece in model_row_pieces(chunk.offsets[0], chunk.sizes[0], value.shape[0], *spec)
    ]


class OwnLayoutSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with each packed tensor's chunk written as its pieces in the model's order."""

    def __init__(self, packed: PackedRows) -> None:
        super().__init__()
        self.packed = packed
        self.rows: dict[tuple[str, tuple[int, ...]], RowPiece] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            pieces = _pieces(self.state_dict, self.mappings, self.packed, item.index.fqn)
            if pieces is None or item.tensor_data is None:
                items.append(item)
                continue
            for piece, chunk in pieces:
                self.rows[(item.index.fqn, tuple(chunk.offsets))] = piece
                index = MetadataIndex(item.index.fqn, chunk.offsets)
                data = dataclasses.replace(item.tensor_data, chunk=chunk)
                items.append(dataclasses.replace(item, index=index, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        offsets = tuple(write_item.index.offset or ())
        piece = self.rows.get((write_item.index.fqn, offsets))
        if piece is None:
            return super().resolve_data(write_item)
        local = self.state_dict[write_item.index.fqn].to_local()
        return local.narrow(0, piece.local, piece.length)


class OwnLayoutLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with each packed tensor's chunk read as its pieces from the model's order."""

    def __init__(self, packed: PackedRows | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.packed = packed or {}
        self.rows: dict[tuple[str, int | None], RowPiece] = {}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()  # checks keys and global shapes as DCP does
        assert self.metadata is not None
        remapped: dict[str, list[ReadItem]] = {}
        for fqn in self.state_dict:
            pieces = _pieces(self.state_dict, self.mappings, self.packed, fqn)
            saved = self.metadata.state_dict_metadata.get(fqn)
            if pieces is None or not isinstance(saved, TensorStorageMetadata):
                continue
            for index, (piece, _) in enumerate(pieces):
                self.rows[(fqn, index)] = piece
            remapped[fqn] = create_read_items_for_chunk_list(fqn, saved, [chunk for _, chunk in pieces])
        kept = [item for item in plan.items if item.dest_index.fqn not in remapped]
        return dataclasses.replace(plan, items=kept + [item for items in remapped.values() for item in items])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self.rows.get((read_item.dest_index.fqn, read_item.dest_index.index))
        if piece is None:
            return super().resolve_tensor(read_item)
        local = self.state_dict[read_item.dest_index.fqn].to_local().narrow(0, piece.local, piece.length)
        return self.transform_tensor(read_item, local)
