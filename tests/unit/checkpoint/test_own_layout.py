"""Sharded checkpoints keep the model's own row order: the row-range mapping of a rank's chunk of a packed
projection (per-rank order) and the DCP planners that write and read each range at its own place.

Mutations seen failing: the model row of a piece computed with the part and rank swapped (``part * slice_rows +
rank * part_rows``: the mapping tests); adjacent pieces not merged (a single-rank layout then writes 3 chunks); the
save planner's pieces written at their per-rank offset (the folder then holds interleaved rows); the load planner
reading packed tensors as DCP's default does (the round trip then holds the model's order in per-rank places)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from lightning_vitscale.checkpoint.safe_reading import load_all, load_into, read_metadata
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.row_layout import (
    OwnLayoutSavePlanner,
    interleaved_rows,
    model_row_pieces,
    model_rows,
    packed_spec,
)


def fsdp_chunks(rows: int, ranks: int, data_parallel: int) -> list[tuple[int, int]]:
    """``(start, length)`` in per-rank order of every rank's chunk: each tensor-parallel rank's slice cut by FSDP
    into ``data_parallel`` dim-0 shards of ``ceil(slice / data_parallel)`` rows (uneven: the last shorter or empty)."""
    size = rows // ranks
    shard = -(-size // data_parallel)
    chunks = []
    for rank in range(ranks):
        for d in range(data_parallel):
            start = min(d * shard, size)
            chunks.append((rank * size + start, min(size, start + shard) - start))
    return chunks


@pytest.mark.parametrize(
    ("rows", "parts", "ranks", "data_parallel"),
    [(24, 3, 2, 1), (24, 3, 2, 2), (24, 3, 2, 3), (96, 3, 4, 2), (30, 3, 2, 4), (12, 2, 3, 5), (18, 3, 1, 4),
     (6, 3, 2, 4)],
)
def test_every_ranks_chunk_maps_to_the_model_rows_it_holds(rows, parts, ranks, data_parallel) -> None:
    """Each rank's chunk filled from the model's own rows through the pieces is exactly that chunk of the
    per-rank order, for even and uneven FSDP shards (30 rows over 2 x 4, 6 over 2 x 4: empty shards); the pieces
    of all ranks tile the model's rows once."""
    model = torch.arange(rows)
    interleaved = interleaved_rows(model, parts, ranks)
    covered = torch.zeros(rows, dtype=torch.long)
    for start, length in fsdp_chunks(rows, ranks, data_parallel):
        pieces = model_row_pieces(start, length, rows, parts, ranks)
        assert len(pieces) <= parts  # a chunk inside one rank's slice: one range per part at most
        chunk = torch.cat([model[p.model : p.model + p.length] for p in pieces]) if pieces else model[:0]
        assert torch.equal(chunk, interleaved[start : start + length])
        assert [p.local for p in pieces] == [sum(q.length for q in pieces[:i]) for i in range(len(pieces))]
        for p in pieces:
            covered[p.model : p.model + p.length] += 1
    assert covered.eq(1).all()


def test_pieces_split_at_each_ranks_slice_of_each_part_and_merge_where_adjacent() -> None:
    # 24 rows, q|k|v of 8 over 2 ranks: rank 0 holds q0 k0 v0 (model rows 0-3, 8-11, 16-19).
    def ranges(*args: int) -> list[tuple[int, int, int]]:
        return [(p.local, p.model, p.length) for p in model_row_pieces(*args)]

    assert ranges(0, 12, 24, 3, 2) == [(0, 0, 4), (4, 8, 4), (8, 16, 4)]
    # A second FSDP shard of rank 1's slice: the end of k1 and all of v1.
    assert ranges(18, 6, 24, 3, 2) == [(0, 14, 2), (2, 20, 4)]
    assert ranges(0, 24, 24, 3, 1) == [(0, 0, 24)]  # no tensor parallelism: one range
    assert model_row_pieces(5, 0, 24, 3, 2) == []


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split into 3 parts over 2 ranks"):
        model_row_pieces(0, 4, 20, 3, 2)
    with pytest.raises(ValueError, match="outside a projection of 24 rows"):
        model_row_pieces(20, 8, 24, 3, 2)


def test_packed_entries_are_found_by_parameter_name_in_weights_optimizer_state_and_ema() -> None:
    packed = {"blocks.0.attn.qkv.weight": (3, 2)}
    assert packed_spec(("state_dict", "blocks.0.attn.qkv.weight"), packed) == (3, 2)
    assert packed_spec(("optimizer_0", "state", "blocks.0.attn.qkv.weight", "exp_avg"), packed) == (3, 2)
    assert packed_spec(("ema_state_dict", "blocks.0._checkpoint_wrapped_module.attn.qkv.weight"), packed) == (3, 2)
    assert packed_spec(("state_dict", "blocks.0.attn.proj.weight"), packed) is None
    assert packed_spec(("blocks.0.attn.qkv.weight",), packed) is None  # a top-level key is no parameter's state


def test_a_folder_holds_the_models_rows_and_loads_back_into_per_rank_order(tmp_path: Path, mesh) -> None:
    """On one rank, a tensor in 2-rank per-rank order (as tensor_parallel=2 holds it, shown here on a 1-rank mesh):
    the folder holds the model's own rows for the weights, the optimizer's state and the EMA, other tensors as
    they are; reading it back with the run's packed projections restores the per-rank order exactly."""
    torch.manual_seed(0)
    own = {"qkv": torch.randn(24, 4), "bias": torch.randn(24), "momentum": torch.randn(24, 4)}
    own["proj"] = torch.randn(4, 8)
    name = "blocks.0.attn.qkv"
    packed = {f"{name}.weight": (3, 2), f"{name}.bias": (3, 2)}

    def state(qkv: torch.Tensor, bias: torch.Tensor, momentum: torch.Tensor, proj: torch.Tensor) -> dict:
        def dt(t: torch.Tensor) -> DTensor:
            return DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False)

        return {
            "state_dict": {f"{name}.weight": dt(qkv), f"{name}.bias": dt(bias), "blocks.0.attn.proj.weight": dt(proj)},
            "optimizer_0": {"state": {f"{name}.weight": {"momentum_buffer": dt(momentum), "step": torch.tensor(3.0)}}},
            "ema_state_dict": {f"{name}.weight": dt(qkv * 2)},
        }

    split = {k: interleaved_rows(v, 3, 2) if k != "proj" else v for k, v in own.items()}
    dcp.save(state(**split), checkpoint_id=str(tmp_path), planner=OwnLayoutSavePlanner(packed))
    folder = Location.of(str(tmp_path))
    chunks = read_metadata(folder, None).state_dict_metadata[f"state_dict.{name}.weight"].chunks
    assert sorted(c.offsets[0] for c in chunks) == [0, 4, 8, 12, 16, 20]  # six (rank, part) slices at their place
    full = load_all(folder, None)
    assert torch.equal(full["state_dict"][f"{name}.weight"], own["qkv"])
    assert torch.equal(full["state_dict"][f"{name}.bias"], own["bias"])
    assert torch.equal(full["state_dict"]["blocks.0.attn.proj.weight"], own["proj"])
    assert torch.equal(full["optimizer_0"]["state"][f"{name}.weight"]["momentum_buffer"], own["momentum"])
    assert torch.equal(full["ema_state_dict"][f"{name}.weight"], own["qkv"] * 2)

    target = state(*(torch.zeros_like(split[k]) for k in ("qkv", "bias", "momentum", "proj")))
    load_into(target, folder, None, packed=packed)
    assert torch.equal(target["state_dict"][f"{name}.weight"].to_local(), split["qkv"])
    assert torch.equal(target["state_dict"][f"{name}.bias"].to_local(), split["bias"])
    assert torch.equal(target["state_dict"]["blocks.0.attn.proj.weight"].to_local(), own["proj"])
    optimizer = target["optimizer_0"]["state"][f"{name}.weight"]
    assert torch.equal(optimizer["momentum_buffer"].to_local(), split["momentum"]) and optimizer["step"].item() == 3.0
    assert torch.equal(target["ema_state_dict"][f"{name}.weight"].to_local(), split["qkv"] * 2)
    plain = state(*(torch.zeros_like(split[k]) for k in ("qkv", "bias", "momentum", "proj")))
    load_into(plain, folder, None)  # a run in the model's own layout (tensor_parallel=1) reads the model's rows
    assert torch.equal(plain["state_dict"][f"{name}.weight"].to_local(), own["qkv"])
    assert torch.equal(model_rows(split["qkv"], 3, 2), own["qkv"])
