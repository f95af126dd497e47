"""Any backbone, proven: a zoo of 16 block families (tests/helpers/zoo.py: timm, HF transformers, torchvision, torch
and hand-written layouts) trains under ``VitScaleStrategy()`` with DDP's losses on 2 CPU ranks (under
``bf16-mixed``, the recipe within bf16 rounding of DDP's AMP), and under
``tensor_parallel=2`` on 4 either with DDP's losses (the same global batch) or is refused at setup with a message
naming the block, the module and the fix; never a failure after setup, never attention left whole unsaid.
lucidrains' ``ModuleList([attention, feed-forward])`` layout trains as DDP for 6 steps: by default, with every block
checkpointed, built in ``configure_model()``, and as ``nn.Sequential`` layers its parent iterates.

Two launches (2 and 4 ranks) run every family; 50-70 s together on the 2-core CI machine. A block every layer
shares (ALBERT's layout) trains as DDP, and checkpointing asked of it says what to name.

Mutations seen failing: units taken whole (the ModuleList layers become units: the 2-rank launch fails at the
layout's first step); the step's ``called`` names not passed to ``parallelize`` (the Sequential layers become
units: the launch fails the same way); the proof's comparison dropped (unknown_head_attribute, whose ``self.h``
heads halve their size when split, trains with other numbers than DDP's and nothing said); the attention-work check
dropped (conv_attention trains with its attention whole on every rank, the MLP alone split, nothing said).
"""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch_ranks
from tests.helpers.results import max_relative_difference
from tests.helpers.zoo import APART, FAMILIES, FOURIER, INTERLEAVED, PARTS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]
SCRIPT = "tests/distributed/scripts/zoo.py"
# What tensor_parallel=2 does to each family: split (the automatic plan, proven), or refused naming what fails.
SPLIT = {"lucid_modulelist", "separate_qkv_nhead", "heads_from_shapes", "timm_vit", "hf_clip"}
REFUSED = {
    "functional_linear": "aten.addmm.default got mixed torch.Tensor and DTensor",  # F.linear on a split weight
    "bias_table": "Its attention also holds attn.table",  # the per-head table stays whole: shapes differ
    "conv_attention": "leaves attention whole",  # Conv1d projections: only the MLP would be split
    "unknown_head_attribute": "gives outputs",  # self.h heads of half the size: numbers differ, nothing raises
    "timm_beit": "Its attention also holds attn.q_bias, attn.v_bias, attn.relative_position_bias_table",
    "timm_swin": "Its attention also holds attn.relative_position_bias_table",
    "torchvision_swin": "aten.addmm.default got mixed torch.Tensor and DTensor",
    "hf_swin": "relative_position_bias_table, which the plan keeps whole",
    "hf_beit": "must match the size of tensor b (4)",  # its bias of every head beside this rank's scores
    "torchvision_vit": "uses nn.MultiheadAttention",
    "torch_encoder": "uses nn.MultiheadAttention",
}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    names = ",".join(["layout", "reused", "two_pass", "self_checkpointed", "parts", "apart", "interleaved",
                      "parametrized", "fourier", "complex_weights", *FAMILIES])
    return launch_ranks(tmp_path_factory, "zoo_2", SCRIPT, names, nprocs=2, timeout=300)[1]


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return launch_ranks(tmp_path_factory, "zoo_4", SCRIPT, ",".join(FAMILIES), nprocs=4, timeout=300)[1]


def losses(ranks: list[dict], family: str, run: str) -> list[float]:
    """Each step's loss over the global batch: the mean of every rank's (a tensor-parallel pair holds the same)."""
    found = [rank[family][run]["losses"] for rank in ranks]
    return [sum(rank[i] for rank in found) / len(found) for i in range(len(found[0]))]


def test_the_zoo_covers_the_families_the_issue_asks_for():
    assert len(FAMILIES) >= 12 and SPLIT | set(REFUSED) == set(FAMILIES) and not SPLIT & set(REFUSED)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_under_the_default_strategy_as_ddp(two, family):
    """And the default planned from the step it measured: HF's Swin, CLIP and BEiT layers need more arguments than
    the hidden states (``input_dimensions``, ``attention_mask``, ``resolution``), which the planner's replay of a
    block alone did not pass until 2026-12-03: the three fell back to every block checkpointed."""
    ddp = losses(two, family, "ddp")
    assert len(ddp) == 3 and max_relative_difference(losses(two, family, "fsdp"), ddp) < 1e-5
    summary = two[0][family]["fsdp"]["summary"]
    assert "through training_step" in summary and "could not run" not in summary, summary


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_under_the_recipe_in_bf16_as_ddp_under_autocast(two, family):
    """The recipe's own precision, bf16 "O2" (no autocast: bf16 weights from FSDP's all-gather, fp32 norms), against
    DDP's AMP O1 from the same weights: within bf16 rounding (at most 0.7% over 24 layouts tried). timm's BEiT and
    Swin raised at their first step while only fp32 runs were checked (an fp32 constant beside bf16 weights)."""
    o1 = losses(two, family, "ddp_bf16")
    assert len(o1) == 3 and max_relative_difference(losses(two, family, "recipe_bf16"), o1) < 0.02


@pytest.mark.parametrize("family", FAMILIES)
def test_under_tensor_parallelism_a_family_trains_as_ddp_or_is_refused_at_setup_naming_the_fix(two, four, family):
    run = four[0][family]["tp2"]
    if family in SPLIT:
        assert "refused" not in run, run.get("refused")
        assert max_relative_difference(losses(four, family, "tp2"), losses(two, family, "ddp")) < 1e-5
        plans = [line for line in run["summary"].splitlines() if line.startswith("    ")]
        assert plans and all("; proven on input" in line and "replicated: " in line for line in plans), plans
        assert any("heads split over 2" in line for line in plans) and not any("whole" in line for line in plans)
        return
    refused = run["refused"]
    assert all(rank[family]["tp2"]["losses"] == [] for rank in four)  # at setup: no step ran
    assert REFUSED[family] in refused and "tensor_plan=" in refused and "tensor_parallel=1" in refused, refused
    if "proven" not in refused and "MultiheadAttention" not in refused:  # the proof names the block and module
        assert "run split on the tensor-parallel group at setup" in refused and " in attn" in refused or (
            " in attention" in refused or "leaves attention whole" in refused), refused


def test_the_fix_a_refusal_names_trains_as_ddp_and_says_the_attention_stays_whole(two, four):
    """torchvision's ViT with ``tensor_plan=`` splitting its MLP only: DDP's losses; the summary says its
    ``nn.MultiheadAttention`` stays whole by that plan, and is replicated."""
    ddp = losses(two, "torchvision_vit", "ddp")
    assert max_relative_difference(losses(four, "torchvision_vit", "tp2_plan"), ddp) < 1e-5
    line = next(x for x in four[0]["torchvision_vit"]["tp2_plan"]["summary"].splitlines() if "EncoderBlock:" in x)
    assert "mlp.0 ColwiseParallel, mlp.3 RowwiseParallel" in line and "attention whole (tensor_plan)" in line
    assert "replicated: ln_1, self_attention, self_attention.out_proj, ln_2" in line


@pytest.mark.parametrize("run", ["default", "checkpointed", "configured", "sequential"])
def test_the_modulelist_layout_trains_as_ddp_each_layer_one_unit_over_what_runs(two, run):
    ddp, ours = two[0]["layout"]["ddp"], two[0]["layout"][run]
    for rank in two:
        assert len(rank["layout"][run]["losses"]) == 6
        assert max_relative_difference(rank["layout"][run]["losses"], rank["layout"]["ddp"]["losses"]) < 1e-5
    assert ours["units"] == [True] * 4  # attention, feed-forward, twice: FSDP modules, each layer's in one unit
    assert "2 repeated containers are never called themselves" in ours["summary"]
    if run == "checkpointed":  # each module checkpointed on its own, one unit per layer
        assert ours["checkpointed"] == ["full"] * 4
        assert ours["fsdp_units"] == 3 and "4 blocks in 2 units" in ours["summary"]
    assert ours["outside"] == pytest.approx(ddp["outside"], rel=1e-5)  # the backbone called after fit


@pytest.mark.parametrize("family", ["shared", "shared_listed"])
def test_a_block_every_layer_shares_trains_as_ddp_and_checkpointing_asked_for_names_the_fix(two, family):
    """ALBERT's layout: one block called 4 times a step is no repetition in the model's structure, so
    ``activation_checkpointing=True`` has no block to checkpoint: it says so (a warning, and the summary's note
    naming the module, its calls per step and ``blocks={Block}``) instead of training with nothing checkpointed
    unsaid. With ``blocks={Block}`` the shared block is a unit of its own (all-gathered and resharded at each of its
    4 calls) checkpointed at each call: DDP's losses either way. Mutation seen failing:
    the call counts not recorded (no warning, no note)."""
    ddp = losses(two, "reused", f"{family}:ddp")
    asked, named = (two[0]["reused"][f"{family}:{run}"] for run in ("asked", "named"))
    block = "backbone.layers.0" if family == "shared_listed" else "backbone.layers"
    assert len(ddp) == 4
    for run in ("asked", "named"):
        assert max_relative_difference(losses(two, "reused", f"{family}:{run}"), ddp) < 1e-5, run
    fix = (f"{block} (Block) runs 4 times per step: if it is a block whose weights its layers share,"
           " pass blocks={Block}")
    assert asked["units"] == [] and asked["checkpointed"] == [None], asked  # in the outer unit (the module's own)
    assert len(asked["warnings"]) == 1 and "nothing is checkpointed" in asked["warnings"][0], asked["warnings"]
    assert fix in asked["warnings"][0] and fix in asked["summary"], asked["summary"]
    assert named["units"] == [block.removeprefix("backbone.")] and named["checkpointed"] == ["full"], named
    # Each unit reduce-scatters once a step (the block's gradient, summed over its 4 calls by autograd), not a zero
    # gradient after each later call's backward (sharding/deferred_reduction.py): 4 steps x (block + outer unit).
    assert named["reduce_scatters"] == 4 * named["fsdp_units"] == 8, named["reduce_scatters"]
    assert not named["warnings"] and "runs 4 times" not in named["summary"]


def test_a_backbone_run_twice_a_step_trains_as_ddp_reducing_each_unit_once_a_step(two):
    """DINO's multi-crop in miniature (every block called on all tokens, then on half of them): DDP's losses, and
    each FSDP unit reduce-scatters once a step. Autograd writes a block's gradient once, after its first call's
    backward; before sharding/deferred_reduction.py FSDP2 reduce-scattered a zero gradient after the second call's
    too (the default's 2 units: 12 reduce-scatters in 4 steps, not 8; a unit per block: 36, not 20). Also with 2
    micro-batches a step (Lightning's no-sync micro-batch first). Mutation seen failing: DeferredReduction not
    installed."""
    for run, ddp_run in (("default", "ddp"), ("per_block", "ddp"), ("per_block_acc2", "ddp_acc2")):
        ddp = losses(two, "two_pass", ddp_run)
        assert len(ddp) == 4 * (2 if ddp_run == "ddp_acc2" else 1)
        assert max_relative_difference(losses(two, "two_pass", run), ddp) < 1e-5, run
        for rank in two:  # accumulating: reduced at the step's last micro-batch only
            facts = rank["two_pass"][run]
            assert facts["reduce_scatters"] == 4 * facts["fsdp_units"], (run, facts["reduce_scatters"])
    assert two[0]["two_pass"]["per_block"]["fsdp_units"] == 5  # 4 blocks and the outer unit


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "sequential"])
def test_blocks_the_model_checkpoints_itself_train_as_ddp(two, how):
    """``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=...)`` or ``checkpoint_sequential`` in the model's
    forward. A reentrant checkpoint runs its blocks without gradients, then again in backward: the skipped-block
    check took them for blocks that never ran and refused the model at its first backward. DDP's losses by default
    and under the recipe's own checkpointing on top. Mutations seen failing: the reentrant forward not marked
    (``SkippedBlocksError``); marked only where the block's own input requires a gradient (``sequential``: the
    segment's second block); the recipe's checkpoint not skipped inside the model's (``block_runs`` 3 a step under
    ``priority="memory"`` with a reentrant checkpoint)."""
    family = f"self_checkpointed:{how}"
    ddp = losses(two, "self_checkpointed", f"{family}:ddp")
    assert two[0]["self_checkpointed"][f"{family}:ddp"]["block_runs"] == [2, 2, 2]  # the forward, the recompute
    for run in ("default", "memory"):
        facts = two[0]["self_checkpointed"][f"{family}:{run}"]
        assert "error" not in facts, facts["error"]
        ours = losses(two, "self_checkpointed", f"{family}:{run}")
        assert len(ddp) == 3 and max_relative_difference(ours, ddp) < 1e-5, run
        # The recipe's checkpoint adds no run inside the model's own (before: 3 a step under a reentrant one). The
        # first step's count also holds setup's runs of the step (the planner's measurement, at global step 0).
        assert facts["block_runs"][1:] == [2, 2], (run, facts["block_runs"])


@pytest.mark.parametrize("family", PARTS)
def test_a_block_made_of_repeated_parts_is_the_unit_and_trains_as_ddp(two, family):
    """torchvision's MaxViT and EfficientNet: before, the repeated parts inside each block were the units (MaxViT's
    window and grid attention, EfficientNet's convolutions) and the rest of every block stayed in the outer unit
    (MaxViT-T: 44 units over 79% of the model; EfficientNet-B0: 36%). Now the block is, as in the recipe; both train
    as DDP by default and with a unit per block; HF's ResNet (its conv layers were the units) and GoogLeNet (the
    convolutions of its Inception blocks' alike branches were) too. Mutations seen failing: ``blocks._alike_siblings``
    always True; ``blocks._widths_change`` always False (hf_resnet); ``blocks._in_branches`` always False
    (googlenet)."""
    ddp = two[0]["parts"][f"{family}:ddp"]["losses"]
    expected = PARTS[family][1]
    for run in ("default", "memory"):
        facts = two[0]["parts"][f"{family}:{run}"]
        assert len(ddp) == 3 and max_relative_difference(facts["losses"], ddp) < 1e-5, run
        found = ", ".join(f"{name} x{count}" for name, count in expected.items())
        assert f"blocks found        : {found}\n" in facts["summary"], facts["summary"]
    assert two[0]["parts"][f"{family}:memory"]["fsdp_units"] == sum(expected.values()) + 1


@pytest.mark.parametrize("family", APART)
def test_blocks_of_containers_that_run_apart_never_share_a_unit_and_train_as_ddp(two, family):
    """HF's Mask2Former: grouped by position alone, its last pixel-decoder projection and its mask MLP's first layer
    made one unit, which the step runs apart (the MLP once per decoder layer, later), and every grouped plan failed
    on resharded weights (DTensor's "mixed torch.Tensor and DTensor", or "data is not allocated"). Its step branches
    on values (and matches with SciPy): measured on fake tensors carrying real values, neighbours share a unit only
    where the measured step ran them back to back (``unit_runs.sharing_keys``). Mutation seen failing:
    ``sharing_keys`` ignoring the measured order (both runs raised)."""
    ddp = two[0]["apart"][f"{family}:ddp"]["losses"]
    for run in ("default", "pinned"):
        facts = two[0]["apart"][f"{family}:{run}"]
        assert "error" not in facts, facts.get("error")
        assert "with real values" in facts["summary"], facts["summary"]
        assert len(ddp) == 3 and max_relative_difference(facts["losses"], ddp) < 1e-5, run
        assert facts["fsdp_units"] > 2, facts["summary"]  # grouped, not one unit of everything


# The blocks in the order the step calls them: HF PoolFormer's patch embeddings and layers (two containers), stage
# after stage; the hand-written top-down pathway's encoder, then its decoder last block first.
CALLED = {
    "hf_poolformer": [name for stage in range(4) for name in (
        f"model.poolformer.encoder.patch_embeddings.{stage}",
        *(f"model.poolformer.encoder.block.{stage}.{layer}" for layer in range(2)))],
    "top_down": [f"layers.{i}" for i in range(4)] + [f"decoder.{i}" for i in (3, 2, 1, 0)],
}


@pytest.mark.parametrize("family", INTERLEAVED)
def test_blocks_called_out_of_model_order_share_units_in_call_order_and_train_as_ddp(two, family):
    """Units are runs of blocks the step calls back to back, taken in the order it calls them: HF PoolFormer's stages
    (a patch embedding, then its layers, each from its own container) and a decoder run last block first share
    units. Until 2026-12-07 a unit was a run in model order, so each patch embedding and each decoder block ran as a
    unit of its own (PoolFormer pinned at 4 blocks a unit: 8 units for 12 blocks, now 3). The planner predicts the
    units made and which stay gathered; DDP's losses. Mutation seen failing: setup listing the blocks in model order
    (``select_units`` without the step's order: the planned units are not the made ones, and more of them)."""
    for run in ("default", "pinned"):
        for rank in two:  # each rank's loss on its own batch
            facts, ddp = rank["interleaved"][f"{family}:{run}"], rank["interleaved"][f"{family}:ddp"]["losses"]
            assert len(ddp) == 3 and max_relative_difference(facts["losses"], ddp) < 1e-5, run
            assert facts["planned"] == facts["made"] and facts["planned_kept"] == facts["kept"], facts["summary"]
        made = two[0]["interleaved"][f"{family}:{run}"]["made"]
        assert [name.removeprefix("backbone.") for unit in made for name in unit] == CALLED[family], made
    pinned = two[0]["interleaved"][f"{family}:pinned"]["made"]
    assert [len(unit) for unit in pinned] == [4] * (len(CALLED[family]) // 4), pinned


def test_weight_parametrizations_train_as_ddp_and_compute_in_fp32_under_the_recipe(two):
    """DINO's head (the old hook-based ``weight_norm``, its ``weight_g`` frozen, the last layer's gradients dropped
    in ``on_after_backward`` as DINO does early on), a ``spectral_norm`` layer and ``parametrizations.weight_norm``
    in every block (``tests/helpers/zoo.py``: ``DinoHeadViT``), 4 steps. fp32: DDP's losses and weights, by default
    and under the recipe's plan, each planned from the step it measured. Before: the planner's copy of the model
    failed on the old API's computed weight (deepcopy refuses a non-leaf tensor), so the default fell back to every
    block checkpointed, and under ``bf16-mixed`` the spectral norm's power iteration met its fp32 vectors with the
    bf16 weight and raised ("addmv input tensors must have the same dtype"). O2 against DDP's AMP: within 0.3% here
    (the hand-written O2 with parametrizations in fp32 is matched bit for bit in ``test_precision.py``). Mutations
    seen failing: no stand-in for the computed weight in ``meta_twin`` ("could not run"), parametrizations left to
    compute in bf16 (the bf16 runs raise)."""
    runs = two[0]["parametrized"]
    ddp = runs["ddp"]
    for run in ("default", "memory"):
        assert runs[run]["losses"] == ddp["losses"] and len(ddp["losses"]) == 4, run
        assert runs[run]["sums"] == ddp["sums"], run
        assert "through training_step" in runs[run]["summary"] and "could not run" not in runs[run]["summary"]
    assert "checkpointed blocks : 0 of 2" in runs["default"]["summary"], runs["default"]["summary"]
    o1 = runs["ddp_bf16"]["losses"]
    for run in ("default_bf16", "memory_bf16"):
        assert len(o1) == 4 and max_relative_difference(runs[run]["losses"], o1) < 0.01, run


@pytest.mark.parametrize("family", FOURIER)
def test_fourier_mixers_train_as_ddp_their_layers_kept_in_fp32_under_the_recipe(two, family):
    """GFNet's global filter (``torch.view_as_complex`` of its weight) and FourCastNet's AFNO (an einsum of the fp32
    spectrum with its weights) raised at the first ``bf16-mixed`` step (no bf16 kernel; float != BFloat16): DDP's AMP
    keeps their weights in fp32. Setup keeps each such layer in fp32 beside the norms (replicated, its gradients
    averaged with theirs), found from the step it runs: within 0.1% of DDP's AMP by default and under the recipe's
    plan; fp32 bit for bit, nothing kept (one device: ``tests/unit/precision/test_low_precision_layers.py``)."""
    runs = two[0]["fourier"]
    assert runs[f"{family}:default"]["losses"] == runs[f"{family}:ddp"]["losses"]
    assert "whose own code raised" not in runs[f"{family}:default"]["summary"]
    o1 = runs[f"{family}:ddp_bf16"]["losses"]
    for run in ("default_bf16", "memory_bf16"):
        facts = runs[f"{family}:{run}"]
        assert len(o1) == 3 and max_relative_difference(facts["losses"], o1) < 1e-3, run
        assert "backbone.layers.0.filter, backbone.layers.1.filter (RuntimeError" in facts["summary"], facts["summary"]


def test_complex_weights_train_checkpoint_and_resume_as_ddp(two):
    """A Fourier neural operator's complex weights (``torch.cfloat``): FSDP2 refused the model at setup ("FSDP expects
    uniform original parameter dtype but got {torch.float32, torch.complex64}"). They are held replicated beside the
    norms in their own dtype (as 0-dim ones are), their gradients averaged as real views: fp32 with clipping, saved
    and resumed, gives DDP's losses and weights bit for bit; ``bf16-mixed`` within 1e-4 of DDP's AMP (the
    non-finite check and the clipping norm, which had no complex kernel or dtype, read the magnitudes)."""
    runs = two[0]["complex_weights"]
    assert runs["default"]["losses"] == runs["ddp"]["losses"] and len(runs["ddp"]["losses"]) == 4
    assert runs["default"]["sums"] == runs["ddp"]["sums"] and len(runs["ddp"]["sums"]) == 4
    assert "4 0-dim or complex parameter(s)" in runs["default"]["summary"], runs["default"]["summary"]
    o1 = runs["ddp_bf16"]["losses"]
    assert len(o1) == 3 and max_relative_difference(runs["default_bf16"]["losses"], o1) < 1e-4
