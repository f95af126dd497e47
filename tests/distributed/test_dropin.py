"""Drop-in from DDP outside ``*_step``: calls from callbacks and after fit, torch.compile'd modules, Lightning's
weight-averaging callbacks and sync_batchnorm; and in a step, embeddings gathered across ranks with their gradients
(a contrastive loss); each compared with the same script under ``strategy="ddp"``."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

SCRIPT = "tests/distributed/scripts/dropin.py"
COMPARED = (
    "outside_steps", "before_first_step", "compiled", "weight_averaging", "stochastic_weight_averaging",
    "sync_batchnorm", "gradient_norms", "backbone_finetuning",
    *(f"contrastive_{gather}_{precision}" for gather in ("lightning", "torch")
      for precision in ("32-true", "bf16-mixed")),
    "clipped_by_hand_norm", "clipped_by_hand_value", "ema_timm", "collectives_in_step",
    "inference_mode_in_hooks_and_steps", "evaluated_in_inference_mode_first", "scalar_reads", "histograms",
    "one_cycle_schedule",
)
ALONE = ("one_rank_call", "one_rank_deepcopy", "one_rank_scalar_read", "logged_rank_zero_only", "one_rank_numpy_read")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    names = [f"{name}/{strategy}" for name in COMPARED for strategy in ("ddp", "vitscale")]
    scenarios = ",".join([*names, *(f"{name}/vitscale" for name in ALONE)])
    return launch_ranks(tmp_path_factory, "dropin", SCRIPT, scenarios, timeout=300)[1]


def _pairs(runs, scenario):
    return [(rank[f"{scenario}/vitscale"], rank[f"{scenario}/ddp"]) for rank in runs]


def _assert_same_numbers(ours: dict, ddp: dict, keys: list[str]) -> None:
    for key in keys:
        assert len(ours[key]) == len(ddp[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(ours[key], ddp[key])) <= 1e-6, key


def test_model_callable_from_callbacks_and_after_fit_like_ddp(runs):
    """pl_module(x) / pl_module.backbone(x) / a child layer, in on_train_batch_end (with and without gradients,
    with a backward), on_after_backward, on_train_end, on_fit_end and after fit returns: DDP's outputs, DDP's
    gradients, and training (losses) and a later validate unaffected."""
    keys = ["losses", "batch_end_grad", "batch_end_child", "after_backward", "after_update", "train_end",
            "train_end_grad_enabled", "fit_end", "after_fit", "after_fit_grad", ]
    for ours, ddp in _pairs(runs, "outside_steps"):
        _assert_same_numbers(ours, ddp, keys)
        assert ours["val_after"] == ddp["val_after"]
        # A no_grad call leaves nothing gathered; an eval loop reshards what a call with gradients kept.
        assert ours["nothing_gathered_after_no_grad_call"] and ours["nothing_gathered_after_validate"]


def test_deep_copies_are_ddps_plain_modules(runs):
    """``copy.deepcopy`` of the model after fit, of a child in a callback (timm's ``ModelEmaV3(model.backbone)``)
    and of the model mid-step (between forward and backward, the weights gathered): plain parameters, no hooks
    (checked in the script), DDP's outputs; training goes on with DDP's losses. Mutation tried: no unit class
    unwrapped (FSDP2 refuses the copy: the launch fails). In this fp32 run a gathered weight holds its shards'
    values: the mid-step mapping to them is held by ``tests/unit/sharding/test_plain_copy.py`` under bf16."""
    for ours, ddp in _pairs(runs, "outside_steps"):
        _assert_same_numbers(ours, ddp, ["deepcopy_after_fit", "deepcopy_child", "deepcopy_in_step", "losses"])


def test_deep_copy_on_one_rank_fails_within_timeout_saying_why(runs):
    facts = runs[0]["one_rank_deepcopy/vitscale"]
    assert facts["error"].startswith("StateDictGatherError: copy.deepcopy() (or torch.save(model), copy.copy)")
    assert "on every rank" in facts["error"] and "timeout" in facts["error"]
    assert facts["seconds"] < 30  # the process-group timeout was 1.5 s


def test_numbers_read_from_sharded_tensors_are_ddps(runs):
    """In ``on_before_optimizer_step``: ``.item()`` of each gradient's norm, ``float()`` of each weight's largest
    magnitude, a sum of squares over the gradients and ``bool()`` of a test on it, ``.item()`` of a ``[1]``
    temperature, and such tensors logged with ``self.log`` (the progress bar on, a logger reading them every step);
    after fit ``float()`` of each weight's sum and of the temperature: DDP's numbers on every rank.
    Mutations tried: torch's own scalar read (this rank's part; the temperature's empty shard raises on rank 1) and
    torch's own max (rank 1's empty shard raises while rank 0 waits in the read): the launch fails either way."""
    for ours, ddp in _pairs(runs, "scalar_reads"):
        assert ours["losses"] == ddp["losses"]
        assert ours["logged"].keys() == ddp["logged"].keys() and len(ours["logged"]) >= 5
        assert ours["logged"] == pytest.approx(ddp["logged"], rel=1e-5, abs=1e-7)
        for key in ("reads", "after_fit"):
            mine, theirs = [sum(rows, []) if key == "reads" else rows for rows in (ours[key], ddp[key])]
            assert len(mine) == len(theirs) > 50, key
            assert all(abs(a - b) <= 1e-5 * abs(b) + 1e-7 for a, b in zip(mine, theirs)), key


def test_histograms_to_tensorboard_are_ddps_and_numpy_reads_in_the_step_keep_the_units_working(runs):
    """Every parameter's and gradient's histogram (``.full_tensor()`` of each under VitScaleStrategy) in
    ``on_after_backward``: DDP's, one event per tag and step. ``np.asarray`` of the head's gathered weight in the step
    (its storage then shared with NumPy): before, FSDP2's reshard raised "Trying to resize storage that is not
    resizable"; DDP's numbers now."""
    for ours, ddp in _pairs(runs, "histograms"):
        assert ours["losses"] == ddp["losses"]
        assert ours["head_sums"] == pytest.approx(ddp["head_sums"], rel=1e-6) and len(ours["head_sums"]) == 3
    ours, ddp = _pairs(runs, "histograms")[0]
    assert ours["histograms"].keys() == ddp["histograms"].keys() and len(ddp["histograms"]) >= 20
    for tag, events in ddp["histograms"].items():
        assert [e[0] for e in ours["histograms"][tag]] == [e[0] for e in events] == [0, 1, 2], tag
        assert sum((e[1:] for e in ours["histograms"][tag]), []) == pytest.approx(sum((e[1:] for e in events), []),
                                                                                  rel=1e-5, abs=1e-9), tag


def test_numpy_of_a_sharded_parameter_on_one_rank_is_refused_at_once_naming_the_fix(runs):
    """``add_histogram(name, p)`` as written for DDP runs ``.numpy()`` on rank 0 alone (the experiment is a no-op on
    the other ranks): torch refused it (".numpy() is not supported for tensor subclasses."); now at once, naming
    ``p.full_tensor()`` on every rank, and nothing was sent."""
    facts = runs[0]["one_rank_numpy_read/vitscale"]
    assert facts["error"].startswith("ShardedArrayReadError: `.numpy()` of a sharded tensor (a DTensor of shape")
    assert "`p.full_tensor()`" in facts["error"] and facts["seconds"] < 1.0


def test_scalar_read_on_one_rank_fails_within_timeout_saying_why(runs):
    """``float(p.abs().max())`` of a sharded weight on rank 0 only (DDP: a local number) combines every rank's part:
    it fails within the timeout naming the fix, having sent nothing on the model's process group."""
    facts = runs[0]["one_rank_scalar_read/vitscale"]
    assert facts["error"].startswith("ScalarReadError: `.item()` / `float()` / `bool()` or `self.log` of a sharded")
    assert "Read or log it on every rank" in facts["error"] and "timeout" in facts["error"]
    assert facts["seconds"] < 30  # the process-group timeout was 1.5 s


def test_a_sharded_number_logged_rank_zero_only_is_refused_at_once_naming_the_fix(runs):
    """``self.log(name, p.abs().max(), rank_zero_only=True)`` in a step, through ``Trainer.fit``: its number needs
    every rank's part, which the flag says rank 0 alone logs; refused in the first step on every rank without any
    wait. Mutation seen failing: the refusal removed (every rank then logs the whole number: fit ends)."""
    for rank in runs:
        facts = rank["logged_rank_zero_only/vitscale"]
        assert facts["error"].startswith("ScalarReadError: `self.log(..., rank_zero_only=True)` of a sharded tensor")
        assert "Log it from every rank" in facts["error"] and facts["seconds"] < 10 and facts["losses"] == 1


def test_model_callable_before_the_first_step_like_ddp(runs):
    """A block unit, the model or a child called from on_{train,validation,test,predict}_start on a fresh model
    (the first forward FSDP sees): DDP's outputs, and the stage that follows runs as under DDP."""
    stages = ("fit", "validate", "test", "predict")
    keys = [f"{stage}_{call}" for stage in stages for call in ("block", "model", "child")]
    for ours, ddp in _pairs(runs, "before_first_step"):
        _assert_same_numbers(ours, ddp, [*keys, "fit_losses", "validate_metrics", "test_metrics", "predictions"])


def test_compiled_module_is_compiled_per_block_with_ddp_losses(runs):
    for ours, ddp in _pairs(runs, "compiled"):
        _assert_same_numbers(ours, ddp, ["losses"])
        assert ours["compiled_blocks"] == "TransformerEncoderLayer x4"  # the user's class, named before FSDP wraps it
        assert ours["blocks_compiled"] and ours["step_not_compiled"]


@pytest.mark.parametrize("scenario", ["weight_averaging", "stochastic_weight_averaging"])
def test_lightning_weight_averaging_matches_ddp(runs, scenario):
    """EMA through WeightAveraging (swapped in for validation, copied in at the end) and SWA: same averages."""
    for ours, ddp in _pairs(runs, scenario):
        assert "error" not in ours, ours.get("error")
        _assert_same_numbers(ours, ddp, ["losses", "averaged_out"])
        assert ours["val_losses"] == ddp["val_losses"]
        assert ours["averaged_copy_sharded"]  # 1/N of the model per rank, not a full copy


def test_sync_batchnorm_refused_on_cpu_before_any_step(runs):
    for ours, ddp in _pairs(runs, "sync_batchnorm"):
        assert "SyncBatchNorm" in ddp["error"] and ddp["steps_run"] == 0  # DDP: torch's check at the first forward
        assert ours["error"].startswith("ValueError: Trainer(sync_batchnorm=True) would turn 9 BatchNorm layer(s)")
        assert "accelerator='cuda'" in ours["error"] and ours["steps_run"] == 0


def test_call_on_one_rank_fails_within_timeout_saying_why(runs):
    facts = runs[0]["one_rank_call/vitscale"]
    assert facts["error"].startswith("OutsideStepCallError: Calling the sharded model outside a training/validation")
    assert "every rank" in facts["error"] and "timeout" in facts["error"]
    assert facts["seconds"] < 30  # the process-group timeout was 1.5 s


def test_gradient_norms_logged_in_on_before_optimizer_step_are_ddps(runs):
    """Lightning's ``grad_norm`` in ``on_before_optimizer_step`` (its docs' example) failed inside Lightning with
    torch's "its data is not allocated yet" (it reads DTensor gradients as plain tensors; found 2026-12-04 running
    user habits). ``lightning_vitscale.grad_norm``, the same call, gives DDP's per-parameter norms and total on every
    rank, and Lightning's own now fails naming it. Mutations seen failing: the norms' all-reduce dropped (each rank's
    shard's norm), the error's context manager removed (torch's message)."""
    for ours, ddp in _pairs(runs, "gradient_norms"):
        assert "error" not in ours and len(ours["norms"]) == len(ddp["norms"]) == 3
        for got, expected in zip(ours["norms"], ddp["norms"]):
            assert got.keys() == expected.keys() and len(got) > 10
            assert all(abs(got[k] - expected[k]) <= 1e-5 * max(1.0, abs(expected[k])) for k in got), (got, expected)
        assert "from lightning_vitscale import grad_norm" in ours["lightning_error"]
        assert ddp["lightning_norms"] == ddp["norms"]  # DDP runs Lightning's own twice: the same numbers


def test_a_backbone_unfrozen_during_fit_trains_as_on_one_device(runs, tmp_path_factory):
    """``BackboneFinetuning`` freezes the backbone before setup and unfreezes it at epoch 1. On 2 ranks DDP never
    averages its gradients (its reducer keeps the parameters that required grad when it was built: each rank steps
    its own, the ranks drift apart; the losses leave the one-device run's from the unfreeze on). FSDP2 reduces
    whatever requires grad at each all-gather: VitScaleStrategy's 2 ranks train as DDP on one device with the same
    global batch (found 2026-12-04 trying Lightning's callbacks; kept by this test)."""
    oracle = launch_ranks(tmp_path_factory, "dropin_one", SCRIPT, "backbone_finetuning/ddp", nprocs=1, timeout=120)[1]
    one_device = oracle[0]["backbone_finetuning/ddp"]["losses"]
    for ours, ddp in _pairs(runs, "backbone_finetuning"):
        assert len(ours["losses"]) == len(one_device) == 6
        assert max(abs(a - b) for a, b in zip(ours["losses"], one_device)) <= 1e-5, (ours, one_device)
        assert max(abs(a - b) for a, b in zip(ddp["losses"][3:], one_device[3:])) > 1e-3  # DDP's drift, as said


@pytest.mark.parametrize("gather", ["lightning", "torch"])
def test_embeddings_gathered_with_their_gradients_train_as_under_ddp(runs, gather):
    """A contrastive loss over the global batch (``self.all_gather(z, sync_grads=True)``, or torch's
    ``all_gather`` of ``torch.distributed.nn``): its backward's collective runs before every unit's reduce-scatter on
    each rank. fp32: DDP's losses and weights bit for bit; bf16: O2 against DDP's AMP (measured 7.3e-3 at the second
    step after a loss of 8.7 at lr 0.05; 8e-4 at the first)."""
    for ours, ddp in _pairs(runs, f"contrastive_{gather}_32-true"):
        assert len(ddp["losses"]) == 4 and ours["losses"] == ddp["losses"]
        assert ours["weights"] == ddp["weights"]
    for ours, ddp in _pairs(runs, f"contrastive_{gather}_bf16-mixed"):
        assert ours["losses"][0] == pytest.approx(ddp["losses"][0], rel=2e-3)
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=2e-2)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_gradients_clipped_by_hand_with_torch_s_functions_train_as_under_ddp(runs, clip):
    """``torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)`` in ``on_before_optimizer_step`` (the total norm over
    every rank's shards, returned as DDP returns it) or ``clip_grad_value_``: DDP's weights within float rounding
    (measured 1.5e-8: the norm summed over shards, then ranks)."""
    for ours, ddp in _pairs(runs, f"clipped_by_hand_{clip}"):
        assert len(ddp["losses"]) == 4 and ours["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
        assert ours["norms"] == pytest.approx(ddp["norms"], rel=1e-6)
        assert len(ours["norms"]) == (4 if clip == "norm" else 0)
        for name, expected in ddp["weights"].items():
            assert ours["weights"][name] == pytest.approx(expected, abs=1e-6), name


def test_a_step_sending_collectives_itself_trains_as_under_ddp(runs):
    """A step that broadcasts a seed from rank 0, waits at a barrier, all-reduces DETR's target count and logs the
    strategy's ``reduce``: the planner ran it at setup on rank 0 alone, and those collectives reached the ranks
    waiting for its plan (gloo killed a rank: "Received data size doesn't match expected size"). Now the planner
    keeps them on its rank and measures the step through ``training_step``; DDP's seeds, losses and weights.
    Mutation seen failing: the fake mode's collectives sent (the launch failed)."""
    for ours, ddp in _pairs(runs, "collectives_in_step"):
        assert len(ddp["losses"]) == 4 and ours["losses"] == ddp["losses"] and ours["seeds"] == ddp["seeds"]
        assert ours["weights"] == ddp["weights"]
        assert "through training_step)" in ours["summary"], ours["summary"]


def test_a_model_called_in_inference_mode_before_training_trains_as_under_ddp(runs):
    """A baseline under ``torch.inference_mode()`` in ``on_train_start`` and a confidence pass under it in each step;
    and ``trainer.validate`` / ``trainer.predict`` before ``trainer.fit`` in inference mode, Lightning's way on
    every GPU (NCCL). FSDP2 keeps the gathered parameters its first gather makes: made in inference mode, the
    training step after failed ("Inference tensors do not track version counter"). DDP's numbers throughout.
    Mutations seen failing (the launch failed): ``FirstGathers.before`` never gathering; the outer unit's gather
    for a call outside a step (``on_train_start``'s) not checked."""
    for ours, ddp in _pairs(runs, "inference_mode_in_hooks_and_steps"):
        _assert_same_numbers(ours, ddp, ["losses", "baseline", "confidence"])
    for ours, ddp in _pairs(runs, "evaluated_in_inference_mode_first"):
        assert ours["in_inference_mode"] == ddp["in_inference_mode"] == [True, True]
        _assert_same_numbers(ours, ddp, ["losses", "val_loss", "predictions"])


def test_timm_s_ema_updated_through_state_dict_moves_as_under_ddp(runs):
    """timm's ``ModelEmaV3`` made in ``__init__`` (sharded with the model) updates ``ema.state_dict()``'s values in
    place: written into the shards (``checkpoint/state_dict_writes.py``), DDP's EMA bit for bit. Before: it never
    moved from its first weights."""
    for ours, ddp in _pairs(runs, "ema_timm"):
        assert len(ddp["losses"]) == 4 and ours["losses"] == ddp["losses"]
        assert ours["ema"] == ddp["ema"]


def test_a_schedule_sized_by_estimated_stepping_batches_trains_as_ddp_on_two_ranks(runs):
    """A OneCycle schedule sized by ``self.trainer.estimated_stepping_batches``, read by a step the planner runs on
    rank 0 alone: Lightning set up the train data there, whose collectives (``has_len_all_ranks``) no other rank
    joined, and the run hung (found 2026-12-07). DDP's losses, rates and length on every rank. Mutation seen failing:
    the planner's stand-in property removed (this launch timed out at 300 s in the scenario)."""
    for ours, ddp in _pairs(runs, "one_cycle_schedule"):
        assert ours["stepping_batches"] == ddp["stepping_batches"] == [6]
        assert ours["rates"] == ddp["rates"] and len(ours["rates"]) == 6
        assert ours["losses"] == ddp["losses"]
