"""Small helpers several concerns share (local shards, byte counts and their text, wrapper prefixes, host memory),
in one home so their rules (FSDP's padding, wrappers' key prefixes) cannot drift apart. Imports only ``_compat``."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import WRAPPER_PREFIXES

GIB = 2**30
MIB = 2**20



def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank actually stores for ``tensors`` (a DTensor counts its local shard only)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def full_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the same tensors take unsharded (what one DDP rank holds)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def shard_rows(rows: int, shard_group: int) -> int:
    """Rows of dim 0 each rank holds: FSDP2 pads dim 0 to a multiple of the shard-group size (``torch.chunk``)."""
    return math.ceil(rows / shard_group)


def shard_numel(shapes: Iterable[Sequence[int]], shard_group: int) -> int:
    """Elements the fullest rank of a shard group holds: FSDP2 shards dim 0 and pads it to a multiple of the
    group size (the padded total is ``shard_group`` times this). The one padded-numel count: the memory model and
    the traffic report both use it."""
    return sum(shard_rows(s[0] if len(s) else 1, shard_group) * math.prod(s[1:]) for s in shapes)


def mib(n: float, digits: int = 1) -> str:
    return f"{n / MIB:,.{digits}f} MiB"


def human_bytes(n: float) -> str:
    """GiB from one GiB up, MiB below: the unit people read memory budgets in."""
    return f"{n / GIB:,.2f} GiB" if n >= GIB else mib(n)


def strip_wrapper_prefixes(name: str) -> str:
    """A parameter's name as the plain module's state dict spells it (and so a DDP checkpoint)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def available_host_bytes() -> int | None:
    """``MemAvailable`` of this host (Linux), or ``None`` where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


# Packed projections (``[q; k; v]``) split by tensor parallelism hold their rows in per-rank order: rank after rank,
# each rank's slice of every part. A Linear so split carries ``(parts, ranks)`` under this attribute; every full view
# of its weights (state dicts, full checkpoints, consolidate) is turned back into the model's own row order.
PACKED_ROWS = "_vitscale_packed_rows"
TENSOR_LAYOUT_KEY = "vitscale_tensor_layout"
"""The checkpoint entry naming projections saved in per-rank row order (absent: the model's own layout)."""


def interleaved_rows(tensor: torch.Tensor, parts: int, ranks: int) -> torch.Tensor:
    """``[p_0 | p_1 | ...]`` (``parts`` blocks of rows) -> each rank's slice of every part, rank after rank."""
    rest = tensor.shape[1:]
    return tensor.reshape(parts, ranks, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def model_rows(tensor: torch.Tensor, parts: int, ranks: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_rows`: per-rank row order -> the model's own ``[p_0 | p_1 | ...]``."""
    rest = tensor.shape[1:]
    return tensor.reshape(ranks, parts, -1, *rest).transpose(0, 1).reshape(tensor.shape)


@dataclass(frozen=True)
class RowPiece:
    """Rows ``[local, local + length)`` of a rank's chunk of a packed projection (per-rank order) are rows
    ``[model, model + length)`` of the model's own order."""

    local: int
    model: int
    length: int


def model_row_pieces(start: int, length: int, rows: int, parts: int, ranks: int) -> list[RowPiece]:
    """Rows ``[start, start + length)`` of a packed projection held in per-rank order (:func:`interleaved_rows` of
    ``rows`` rows, ``parts`` parts over ``ranks`` ranks) as contiguous row ranges of the model's own order.

    Each rank's slice of each part (``rows / (parts * ranks)`` rows) is contiguous in both orders, so the range
    splits at those boundaries only (adjacent ranges merged): a chunk that tensor parallelism and FSDP's dim-0
    shards give one rank maps to at most ``parts`` ranges, which a checkpoint writes and reads at their own place.
    """
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


def packed_rows(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``{parameter name (wrapper prefixes stripped): (parts, ranks)}`` of every packed projection in ``module``."""
    found: dict[str, tuple[int, int]] = {}
    for name, sub in module.named_modules():
        spec = sub.__dict__.get(PACKED_ROWS)
        if spec is not None:
            for param, _ in sub.named_parameters(recurse=False):
                found[strip_wrapper_prefixes(f"{name}.{param}" if name else param)] = spec
    return found


def reorder_packed(
    tensors: dict[str, Any], packed: dict[str, tuple[int, int]], to_model: bool, prefix: str = ""
) -> None:
    """In place: each full tensor of ``tensors`` (keyed ``prefix`` + parameter name) that ``packed`` lists, or a
    dict of such tensors (an optimizer's per-parameter state: tensors of the parameter's shape), turned into the
    model's own row order (``to_model``) or into per-rank order."""
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
