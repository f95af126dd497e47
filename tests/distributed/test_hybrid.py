"""Beyond one node: 2 "nodes" x 2 CPU ranks on localhost, each node its own process tree (torchrun per node,
and Lightning's launcher per node). Full and hybrid sharding against DDP, per-rank state, the bytes really
sent inside / across nodes against the plan, fp32 norms on a 2-D mesh, and checkpoints moved between layouts
and world sizes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import assert_ok, lightning_launch, multinode_launch, torchrun
from tests.helpers.results import load_ranks, max_relative_difference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
SCRIPT = "tests/distributed/scripts/hybrid.py"
# Scalar all-reduces the plan leaves out: the loss logged with sync_dist (6 bytes sent per rank over 4 ranks),
# the gradient-norm all-reduce of clipping (<= 6 bytes) and, under bf16, the non-finite guard's flags (2 int32 per
# rank: a ring all-reduce of 32 bytes sends 48 bytes per rank over 4 ranks).
SCALARS = 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid")
    for node in multinode_launch(SCRIPT, str(out), "nodes", launcher="torchrun", timeout=300):
        assert_ok(node)
    # The hybrid checkpoint resumed under full sharding on 2 ranks and on 1 (a plain process), at the same time:
    # both only read it.
    with ThreadPoolExecutor(max_workers=2) as pool:
        two = pool.submit(torchrun, SCRIPT, str(out), "two", nprocs=2, timeout=180)
        one = pool.submit(lightning_launch, SCRIPT, str(out), "one", timeout=180)
        assert_ok(two.result())
        assert_ok(one.result())
    return out, load_ranks(out, "nodes-rank*.json")


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid_lightning")
    for node in multinode_launch(SCRIPT, str(out), "lightning", launcher="lightning", timeout=240):
        assert_ok(node)
    return load_ranks(out, "lightning-rank*.json")


def test_full_and_hybrid_match_ddp_from_rank_dependent_init(run):
    _, ranks = run
    assert len(ranks) == 4
    for rank in ranks:
        ddp = rank["ddp"]["losses"]
        for layout in ("full", "hybrid"):
            assert len(rank[layout]["losses"]) == 8
            assert max_relative_difference(rank[layout]["losses"], ddp) < 1e-5, layout


def test_hybrid_shards_within_each_node_and_holds_half(run):
    _, ranks = run
    for rank in ranks:
        hybrid, full = rank["hybrid"], rank["full"]
        assert hybrid["placements"] == ["R", "S(0)"] and hybrid["mesh"] == [[0, 1], [2, 3]]
        assert full["placements"] == ["S(0)"] and full["mesh"] == [0, 1, 2, 3]
        assert 0.45 < hybrid["fraction"] < 0.55  # 1/2: shard group of 2
        assert 0.20 < full["fraction"] < 0.30  # 1/4: shard group of 4
        assert rank["ddp"]["fraction"] == 1.0


@pytest.mark.parametrize("layout", ["full", "hybrid", "bf16"])
def test_planned_traffic_matches_the_collectives_issued(run, layout):
    _, ranks = run
    for rank in ranks:
        facts = rank[layout]
        planned_intra, planned_inter = facts["planned"]
        assert len(facts["measured"]) >= 3
        for intra, inter in facts["measured"]:
            assert abs(intra - planned_intra) <= SCALARS and abs(inter - planned_inter) <= SCALARS, facts["measured"]


def test_hybrid_keeps_gathers_inside_the_node_and_sends_at_most_half_across(run):
    _, ranks = run
    for rank in ranks:
        full, hybrid = rank["full"]["measured"][-1], rank["hybrid"]["measured"][-1]
        assert full[0] <= SCALARS  # every full-sharding collective spans both nodes
        assert hybrid[0] > 100_000  # all-gathers and reduce-scatters inside the node
        assert hybrid[1] <= full[1] / 2  # shard size 2
        # what the full-sharding summary announces for hybrid is what hybrid then sends
        assert abs(rank["full"]["hybrid_planned"] - hybrid[1]) <= SCALARS
        assert "would send" in rank["full"]["summary"] and "hybrid (2 replicas x 2-rank" in rank["hybrid"]["summary"]


def test_fp32_norms_are_replicated_on_both_mesh_dims_and_stay_equal(run):
    _, ranks = run
    for rank in ranks:
        facts = rank["bf16"]
        assert facts["norm_placements"] == ["R", "R"] and facts["norm_dtype"] == "torch.float32"
        assert facts["norms_equal_on_all_ranks"] and facts["norm_moved"]
        assert all(loss == loss for loss in facts["losses"])


def snapshots_equal(saved: Path, restored: Path) -> None:
    a, b = torch.load(saved), torch.load(restored)
    assert a.keys() == b.keys() and any(k.startswith("o.") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def test_hybrid_checkpoint_resumes_under_full_sharding_on_2_and_1_ranks(run):
    out, _ = run
    saved = out / "hybrid-saved-rank0.pt"
    for world, ranks in ((2, (0, 1)), (1, (0,))):
        for rank in ranks:
            snapshots_equal(saved, out / f"hybrid_to_full_{world}-restored-rank{rank}.pt")
        facts = load_ranks(out, "two-rank*.json" if world == 2 else "one-rank*.json")
        assert len(facts) == world and all(f["global_step"] == 9 for f in facts)


def test_full_checkpoint_resumes_under_hybrid(run):
    out, ranks = run
    for rank, facts in enumerate(ranks):
        snapshots_equal(out / f"full-saved-rank{rank}.pt", out / f"full_to_hybrid-restored-rank{rank}.pt")
        assert facts["full_to_hybrid"]["global_step"] == 9


def test_lightning_launcher_per_node_matches_ddp(lightning_run, run):
    _, ranks = run
    assert len(lightning_run) == 4
    for ours, oracle in zip(lightning_run, ranks):
        for layout, mesh in (("full", [0, 1, 2, 3]), ("hybrid", [[0, 1], [2, 3]])):
            facts = ours[layout]
            assert facts["cluster"] == "LightningEnvironment" and facts["mesh"] == mesh
            assert len(facts["losses"]) == 4
            assert max_relative_difference(facts["losses"], oracle["ddp"]["losses"][:4]) < 1e-5
