"""``model.state_dict()`` / ``model.load_state_dict()`` of the sharded model, compared with ``strategy="ddp"``: plain
full tensors in callbacks and after fit, files a plain script loads, loading plain weights, torch's own errors."""

from __future__ import annotations

import pytest

from tests.helpers.launch import assert_ok, torchrun
from tests.helpers.results import load_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/distributed/scripts/full_state_dict.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("full_state_dict")
    assert_ok(torchrun(SCRIPT, str(out), "state_dicts/ddp,state_dicts/vitscale,one_rank_call/vitscale", timeout=240))
    return load_ranks(out)


def _pairs(runs):
    return [(rank["state_dicts/vitscale"], rank["state_dicts/ddp"]) for rank in runs]


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_state_dict_is_ddps_plain_full_tensors_in_callbacks_and_after_fit(runs):
    for ours, ddp in _pairs(runs):
        for point in ("mid", "mid_head", "final"):
            assert ours[point] == ddp[point], point  # same keys, dtypes, plain tensors on the CPU
            assert ours[point]["types"] == ["Tensor"] and ours[point]["devices"] == ["cpu"], point
            assert ours[f"{point}_diff"] <= 1e-5, point
        assert ours["train_end_diff"] <= 1e-5
        assert ours["backbone"] == ddp["backbone"]
        assert ours["losses"] == pytest.approx(ddp["losses"], abs=1e-5)  # taking them changed no step


def test_saved_file_loads_into_a_plain_model_in_another_script(runs):
    for ours, ddp in _pairs(runs):
        assert ours["plain_load"] == ddp["plain_load"] == "<All keys matched successfully>"
        assert _close(ours["plain_outputs"], ours["outputs"], 1e-6)
        assert _close(ours["plain_outputs"], ddp["plain_outputs"])


def test_load_state_dict_of_plain_weights_like_ddp(runs):
    for ours, ddp in _pairs(runs):
        assert ours["load"] == ddp["load"] == ours["head_load"] == "<All keys matched successfully>"
        assert ours["loaded_diff"] == 0.0
        for key in ("loaded_outputs", "head_loaded_outputs", "after_errors_outputs"):
            assert _close(ours[key], ddp[key], 1e-6), key
        assert ours["non_strict"] == ddp["non_strict"] and "backbone.head.bias" in ours["non_strict"]


def test_load_errors_are_torchs_own_messages(runs):
    for ours, ddp in _pairs(runs):
        for key in ("strict_missing_error", "shape_error", "unexpected_error"):
            assert ours[key] == ddp[key], key
            assert ours[key].startswith("RuntimeError: Error(s) in loading state_dict for Classifier:"), key
        assert "size mismatch for backbone.head.weight" in ours["shape_error"]


def test_weights_loaded_in_a_callback_are_the_ones_tested(runs):
    for ours, ddp in _pairs(runs):
        assert ours["test_load"] == ddp["test_load"] == "<All keys matched successfully>"
        assert ours["test_loaded_diff"] == ddp["test_loaded_diff"] == 0.0
        assert ours["test_acc"] == pytest.approx(ddp["test_acc"], abs=1e-6)


def test_strategy_checkpoints_stay_sharded(runs):
    for ours, _ in _pairs(runs):
        assert ours["shards_still_dtensors"] and ours["checkpoint_is_sharded_folder"]
        assert ours["checkpoint_state_is_sharded"]


def test_state_dict_on_one_rank_fails_within_the_timeout_naming_the_fixes(runs):
    facts = runs[0]["one_rank_call/vitscale"]
    assert facts["error"].startswith("StateDictGatherError: state_dict() of a model sharded by VitScaleStrategy")
    for fix in ("on every rank", "trainer.save_checkpoint(path)", "state_dict_type='full'", "consolidate"):
        assert fix in facts["error"], fix
    assert facts["seconds"] < 3.0 + 5.0  # the 3 s timeout, not a hang
