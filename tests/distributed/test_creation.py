"""Models built in configure_model are created sharded: DDP's exact weights, or their own init on meta shards."""

from __future__ import annotations

import pytest

from tests.helpers.launch import assert_ok, launch_ranks, torchrun
from tests.helpers.results import load_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

KINDS = ("distinctive", "examples_vit", "timm", "hf")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    scenarios = ",".join([*(f"exact/{kind}" for kind in KINDS), "meta_stats", "meta_hybrid", "explicit_meta_refused",
                          "reuse"])
    return launch_ranks(tmp_path_factory, "creation", "tests/distributed/scripts/creation.py", scenarios)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_exact_path_starts_from_ddp_weights(ranks, kind):
    """Rank 0 builds, the others build on meta and receive their shards: losses equal DDP's bit for bit on every
    rank, also with dropout after the build (the other ranks continue from rank 0's RNG state, as under DDP)."""
    for rank in ranks:
        facts = rank[f"exact/{kind}"]
        assert facts["path"] == "exact"
        assert facts["vitscale"] == facts["ddp"]
        assert facts["device"] == "cpu"  # LightningModule.device names the training device after setup
        assert "initial weights     : exact" in facts["summary"]


def test_meta_path_replays_the_models_own_init(ranks):
    for rank in ranks:
        facts = rank["meta_stats"]
        assert facts["path"] == "meta" and facts["finite"]
        # self.apply(init): normal std 0.05 and constant 0.3 biases (torch's default would be uniform, std ~0.07).
        assert abs(facts["weight_std"] - 0.05) < 0.002 and abs(facts["weight_mean"]) < 0.002
        assert facts["bias_values"] == [pytest.approx(0.3)]
        assert facts["shards_differ"]  # each shard draws its own values: no copies of rank 0's rows
        # The examples' ViT: trunc_normal(std=0.02) from `self.apply(init_vit_weights)`, not nn.Linear's default
        # (kaiming uniform, std 0.072 for its 64 inputs).
        assert abs(facts["vit_fc1_std"] - 0.02) < 0.002
    warnings = ranks[0]["meta_stats"]["warnings"]
    assert len(warnings) == 1 and "net.head.weight" in warnings[0] and "orthogonal_" in warnings[0]


def test_meta_path_under_hybrid_sharding_gives_replicas_the_same_values(ranks):
    """Two ranks, hybrid sharding with 1-rank shard groups: each rank holds a replica of the whole model.

    Mutation seen failing: the seed's shard index taken from the global rank (the replicas then differ)."""
    for rank in ranks:
        facts = rank["meta_hybrid"]
        assert facts["path"] == "meta" and facts["replicas_differ"] is False


def test_exact_refuses_a_model_built_on_meta_by_hand(ranks):
    for rank in ranks:
        assert "init='meta'" in rank["explicit_meta_refused"]["error"]


def test_second_trainer_reuses_only_matching_settings(ranks):
    for rank in ranks:
        facts = rank["reuse"]
        assert facts["reused_steps"] == 6  # 2 + 4 more steps with the same settings on the same units
        assert "activation_checkpointing= None -> False" in facts["error"]  # the default leaves it to the planner
        assert "new LightningModule instance" in facts["error"]


def test_four_ranks_hold_one_copy_at_most_during_setup(tmp_path):
    """A 269 MB model built in configure_model on 4 ranks: rank 0 holds the one full copy it builds, the others
    only their shards (peak RSS growth from setup to on_train_start), and a step trains."""
    assert_ok(torchrun("tests/distributed/scripts/creation.py", str(tmp_path), "memory", nprocs=4, timeout=180))
    ranks = load_ranks(tmp_path)
    assert len(ranks) == 4
    for index, rank in enumerate(ranks):
        facts = rank["memory"]
        assert facts["path"] == "exact" and facts["trained"] == 1 and facts["all_dtensors"]
        assert facts["local"] == facts["full"] // 4
        # Rank 0: its one full copy and its shards, never a second copy (2x). Measured 1.08x typically, once 1.155x
        # in a CI run (sampled RSS catches a transient unit in flight): 1.25x keeps the margin, and the copy caught.
        limit = 1.25 if index == 0 else 0.40
        assert facts["growth"] <= limit * facts["full"], (index, facts["growth"] / facts["full"])
