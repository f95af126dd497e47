"""``model.state_dict()`` / ``model.load_state_dict()`` of the sharded model, compared with ``strategy="ddp"``: plain
full tensors in callbacks and after fit, files a plain script loads, loading plain weights, torch's own errors."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = "tests/distributed/scripts/full_state_dict.py"
DURING_TRAINING = tuple(f"during_training/{name}"
                        for name in ("state_dict", "model_call", "at_batch_start", "disagree", "other_module",
                                      "validation_end"))
ORACLES = {name: "validation_end/no_call" for name in ("during_training/validation_end", "in_step/validation_alone")}
IN_STEP = tuple(f"in_step/{name}" for name in ("training_alone", "validation_alone", "every_rank/ddp",
                                                "every_rank/vitscale"))
IN_STEP_ERROR = "InStepCallError: Calling `backbone.encoder.layers.0` a 2nd time in this step"
STATE_DICT_ERROR = "StateDictGatherError: state_dict() of a model sharded by VitScaleStrategy"
CALL_ERROR = "OutsideStepCallError: Calling the sharded model outside a training/validation step"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    names = ["state_dicts/ddp", "state_dicts/vitscale", *DURING_TRAINING, "validation_end/no_call", *IN_STEP,
             "one_rank_call/vitscale"]
    return launch_ranks(tmp_path_factory, "full_state_dict", SCRIPT, ",".join(names))[1]


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
    assert facts["seconds"] < 1.5 + 5.0  # the 1.5 s timeout, not a hang


def _trained_on_unaffected(runs, scenario: str) -> None:
    """Every rank ran all its steps with the losses of the run where every rank gathered, or, with validation (whose
    dataloader draws from the global RNG, so dropout's masks differ after it, as under DDP), of the same run without
    the call: nothing sent, nothing lost (the ranks that went on waited in their step's all-gather, or their
    collective, until the failed call's rank came back)."""
    oracle = ORACLES.get(scenario, "state_dicts/vitscale")
    for rank in runs:
        facts = rank[scenario]
        assert facts["fit_error"] is None, facts["fit_error"]
        assert facts["losses"] == pytest.approx(rank[oracle]["losses"], abs=1e-6)


@pytest.mark.parametrize(
    "scenario, error, what",
    [
        ("during_training/state_dict", STATE_DICT_ERROR, "not every rank made state_dict(): rank 1 went on to a"),
        ("during_training/model_call", CALL_ERROR, "not every rank made a call of the model (or a submodule) outside a"
         " step: rank 1 went on to a later step"),
        # Mutation seen failing: no batch counted by the strategy's training_step (ShardedModel.before_training_step).
        ("during_training/at_batch_start", STATE_DICT_ERROR, "not every rank made state_dict(): rank 1 went on to a"),
        # In on_validation_epoch_end, ModelCheckpoint on: rank 1 is in a collective of the Trainer's, where rank 0
        # has not been (mutation seen failing: no collective counted by counting_whereabouts).
        ("during_training/validation_end", STATE_DICT_ERROR, "not every rank made state_dict(): rank 1 waits in the"
         " strategy's `"),
    ],
)
def test_gather_on_one_rank_during_training_fails_clearly_and_sends_nothing(runs, scenario, error, what):
    """`if trainer.is_global_zero:` in on_train_batch_end while the other rank trains on: without the handshake,
    both ranks waited out the whole timeout and the training died on both (or gloo aborted the process). The
    calling rank learns within about a second (``handshake.FIRST_ASK_S``) that the other rank started its next
    batch, or within two asks that it stays in a collective of the Trainer's (on_validation_epoch_end, before
    ModelCheckpoint's), not after the strategy's 20 s timeout (mutation seen failing: ``whereabouts.not_coming``
    returning ``None``, the call then waiting out the 20 s; it waited out the whole timeout before this check
    existed)."""
    facts = runs[0][scenario]
    assert facts["error"].startswith(error) and what in facts["error"], facts["error"]
    assert "nothing was gathered" in facts["error"] and "on every rank" in facts["error"]
    assert facts["seconds"] < 5.0  # the other rank's whereabouts, not the strategy's 20 s timeout
    assert "error" not in runs[1][scenario]  # rank 1 made no call
    _trained_on_unaffected(runs, scenario)


def test_different_gathers_on_different_ranks_fail_on_every_rank_at_once(runs):
    """Rank 0 calls state_dict() while rank 1 calls the model at the same point: both get their clear error at
    once (without the handshake, gloo aborted rank 0's process on the size mismatch)."""
    rank0, rank1 = (rank["during_training/disagree"] for rank in runs)
    assert rank0["error"].startswith(STATE_DICT_ERROR), rank0["error"]
    assert rank1["error"].startswith(CALL_ERROR), rank1["error"]
    for facts in (rank0, rank1):
        assert "the ranks made different calls at this point (state_dict() on some ranks, a call of the model" in (
            facts["error"]
        )
        assert facts["seconds"] < 1.0  # no timeout, no asking: the last rank to arrive at this point tells
    _trained_on_unaffected(runs, "during_training/disagree")


def test_state_dicts_of_different_modules_on_different_ranks_fail_at_once(runs):
    """Rank 0 gathers the whole model, rank 1 only the head: both stop before the first tensor."""
    for rank in runs:
        facts = rank["during_training/other_module"]
        assert facts["error"].startswith(STATE_DICT_ERROR), facts["error"]
        assert "the ranks made state_dict() at this point, but of different modules or tensors" in facts["error"]
        assert facts["seconds"] < 1.0  # the last rank to arrive tells, within milliseconds
    _trained_on_unaffected(runs, "during_training/other_module")


@pytest.mark.parametrize(
    "scenario, why",
    [
        ("in_step/training_alone", "rank 1 went on to a backward this rank has not started"),
        # the only validation batch: rank 1 went on to the epoch's `sync_dist` reduce
        ("in_step/validation_alone", "rank 1 waits in the strategy's `reduce`"),
    ],
)
def test_a_call_in_a_step_on_one_rank_fails_before_it_gathers_and_training_goes_on(runs, scenario, why):
    """``if self.global_rank == 0: self(images)`` after the step's own forward (DDP: a local call). Before the guard,
    with every unit resharded, the other rank's gloo aborted the process (its gathers paired with rank 0's extra
    ones) or the step timed out; now rank 0 fails before any gather, within seconds, naming the block, why and the
    fix; caught, the training goes on with the losses of the run without the call (mutations seen failing: no
    guard installed, the launch then failing; no check before the gather ahead of the first block, rank 1 then
    timing out in its backward)."""
    facts = runs[0][scenario]
    assert facts["error"] is not None and facts["error"].startswith(IN_STEP_ERROR), facts["error"]
    assert why in facts["error"] and "Make the same calls of the model in a step on every rank" in facts["error"]
    assert facts["seconds"] < 5.0, facts["error"]
    assert "error" not in runs[1][scenario]  # rank 1 made no call
    _trained_on_unaffected(runs, scenario)


def test_a_call_in_a_step_on_every_rank_gives_ddps_outputs(runs):
    """The same extra call on every rank (the fix the error names): agreed once, in the first step that makes it, and
    the outputs and losses are DDP's."""
    for rank in runs:
        ours, ddp = rank["in_step/every_rank/vitscale"], rank["in_step/every_rank/ddp"]
        assert ours["error"] is None and ours["fit_error"] is None, ours
        assert ours["outputs"] == pytest.approx(ddp["outputs"], abs=1e-5)
        assert ours["losses"] == pytest.approx(ddp["losses"], abs=1e-5)
