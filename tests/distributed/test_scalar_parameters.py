"""0-dim parameters (CLIP's ``logit_scale``; a LightningModule's own, used in ``training_step``; a gate in each
block) on 2 gloo ranks, DDP as the oracle: held replicated with the norms (``sharding/scalar_parameters.py``), their
gradients averaged, the same values on every rank. One device and HF's CLIPModel:
``tests/unit/sharding/test_scalar_parameters.py``.

Mutations seen failing: the values not prepared before replication (``weights.prepare_parameters`` removed: each
rank keeps its own init, the losses differ from DDP's); the gradients not averaged (``reduce_grads`` skipping 0-dim
ones: ranks drift apart); ``shard_like`` leaving them plain in Lightning's averaged copy (the EMA run fails).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_vitscale.__main__ import main
from lightning_vitscale.checkpoint.safe_reading import load_pickle
from tests.helpers.contrastive import TemperatureClip
from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
SCRIPT = "tests/distributed/scripts/scalar_parameters.py"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, list[dict]]:
    scenarios = "train/ddp,train/default,train/memory,resume,averaged/ddp,averaged/default"
    return launch_ranks(tmp_path_factory, "scalar_parameters", SCRIPT, scenarios, timeout=240)


@pytest.fixture(scope="module")
def ranks(launched) -> list[dict]:
    return launched[1]


@pytest.mark.parametrize("plan", ["default", "memory"])
def test_0_dim_parameters_train_as_under_ddp_on_2_ranks(ranks, plan):
    for rank in ranks:
        ddp, ours = rank["train/ddp"], rank[f"train/{plan}"]
        assert len(ddp["losses"]) == 4 and ours["losses"] == ddp["losses"]
        assert ours["temperatures"] == ddp["temperatures"]
        assert ours["scalars"] == ddp["scalars"] and len(ours["scalars"]) == 6
    assert ranks[0][f"train/{plan}"]["scalars"] == ranks[1][f"train/{plan}"]["scalars"]


@pytest.mark.parametrize("saver", ["default", "ddp"])
def test_a_run_resumed_from_a_sharded_or_a_ddp_checkpoint_continues_as_ddp(ranks, saver):
    """Resumed at step 2 from ``VitScaleStrategy()``'s own folder or DDP's file: steps 3-4 as DDP resumed from its
    file (the 2-step runs were DDP's bit for bit)."""
    for rank in ranks:
        resumed, ddp = rank["resume"][f"{saver}->default"], rank["resume"]["ddp->ddp"]
        assert len(ddp["losses"]) == 2 and resumed["losses"] == ddp["losses"]
        assert resumed["scalars"] == ddp["scalars"]


def test_the_sharded_folder_consolidates_to_ddps_file(launched, tmp_path):
    """``consolidate`` of the step-2 folder: DDP's step-2 state dict, 0-dim tensors of shape ``()``, bit for bit,
    loading strictly into the plain module."""
    out = launched[0]
    assert main(["consolidate", str(out / "default-step2.ckpt"), str(tmp_path / "plain.ckpt")]) == 0
    ours = load_pickle(tmp_path / "plain.ckpt", weights_only=True)["state_dict"]
    ddp = load_pickle(out / "ddp-step2.ckpt", weights_only=True)["state_dict"]
    assert ours.keys() == ddp.keys() and all(ours[k].equal(ddp[k]) for k in ddp)
    assert ours["net.logit_scale"].shape == () and ours["net.text.blocks.1.gate"].shape == ()
    TemperatureClip().load_state_dict(ours, strict=True)


def test_lightning_s_weight_averaging_averages_them_as_under_ddp(ranks):
    """The averaged copy holds them replicated too (``averaging/lightning_callbacks.shard_like``): validation on the
    averaged weights and the values left after ``fit`` are DDP's."""
    for rank in ranks:
        ddp, ours = rank["averaged/ddp"], rank["averaged/default"]
        assert len(ddp["validation"]) == 4 and ours["validation"] == ddp["validation"]
        assert ours["losses"] == ddp["losses"] and ours["scalars"] == ddp["scalars"]
