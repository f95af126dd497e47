"""Sharded checkpoints in the model's own row order, whatever tensor-parallel layout the run holds.

Tensor parallelism keeps a packed ``[q; k; v]`` projection in per-rank row order (``_utils.interleaved_rows``), and
DCP writes each rank's chunk at its offset in that order. These planners write and read it in the model's own
order instead: a rank's chunk (a contiguous range of per-rank rows, after the tensor-parallel split and FSDP's
dim-0 shard) is at most ``parts`` contiguous ranges of the model's rows (``_utils.model_row_pieces``); each range
is one DCP chunk at its own offset. DCP then reshards as for any tensor, so a folder saved under one layout loads
under any other (tensor_parallel=1, another world size, DDP through ``consolidate``) and its tensors are what the
model's ``state_dict`` holds. The same applies to every tensor of a packed parameter's shape held like it: the
optimizer's state (``optimizer_<i>.state.<name>.<key>``) and ``ShardedEMA``'s average (``ema_state_dict.<name>``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from lightning_vitscale._utils import RowPiece, model_row_pieces, strip_wrapper_prefixes

PackedRows = dict[str, tuple[int, int]]
"""``{parameter name: (parts, ranks)}`` of the projections held in per-rank row order (``_utils.packed_rows``)."""

Piece = tuple[RowPiece, ChunkStorageMetadata]


def packed_spec(path: tuple[Any, ...], packed: PackedRows) -> tuple[int, int] | None:
    """``(parts, ranks)`` when the state-dict entry at ``path`` (DCP's flattening: the top-level key, then the
    keys inside) belongs to a packed parameter: the parameter itself, or its optimizer state or EMA."""
    for key in path[1:]:
        if isinstance(key, str):
            spec = packed.get(strip_wrapper_prefixes(key))
            if spec is not None:
                return spec
    return None


def own_layout_pieces(tensor: DTensor, spec: tuple[int, int]) -> list[Piece]:
    """This rank's chunk of ``tensor`` (per-rank rows) as pieces: where each lies in the local tensor, and its
    chunk of the tensor in the model's own row order."""
    (chunk,) = tensor.__create_chunk_list__()  # DCP's own: this rank's offsets and sizes in the global tensor
    rest_offsets, rest_sizes = tuple(chunk.offsets[1:]), tuple(chunk.sizes[1:])
    return [
        (piece, ChunkStorageMetadata(torch.Size((piece.model, *rest_offsets)), torch.Size((piece.length, *rest_sizes))))
        for piece in model_row_pieces(chunk.offsets[0], chunk.sizes[0], tensor.shape[0], *spec)
    ]


def _pieces(state_dict: dict[str, Any], mappings: dict[str, Any], packed: PackedRows, fqn: str) -> list[Piece] | None:
    value = state_dict.get(fqn)
    if not packed or not isinstance(value, DTensor) or value.dim() == 0:
        return None
    spec = packed_spec(tuple(mappings.get(fqn, (fqn,))), packed)
    return None if spec is None else own_layout_pieces(value, spec)


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
