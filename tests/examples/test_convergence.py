"""Each example actually learns on CPU under vitscale, and learns what ddp learns, step by step.

Same seed, same data order, same model: sharding must not change what is learned, only how it is
stored, so the two strategies should agree up to float reduction order. The vitscale run goes to the end and must
clear the bar; the ddp oracle runs the same schedule (same ``max_epochs``, so the same learning-rate curve) but is
stopped after its first epoch, whose training loss must match vitscale's at every step and whose validation
metric must match vitscale's first. (Until 2026-11-28 the oracle ran two epochs and only the per-epoch metric was
compared: for video both epochs sat at chance, 0.125, so the comparison said little; per-step losses were equal
to the last digit in all three tasks, measured that day.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples._run import run_example

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

NO_CKPT = ["--trainer.enable_checkpointing=false"]
EVERY_STEP = ["--trainer.log_every_n_steps=1"]  # train_loss in metrics.csv at every step
ORACLE_EPOCHS = 1
STOP_ORACLE = ["--trainer.callbacks+=tests.helpers.stop_after.StopAfterEpochs",
               f"--trainer.callbacks.epochs={ORACLE_EPOCHS}"]
LOSS_RTOL = 1e-5  # rank 0's loss per step; measured equal to the last digit (float reduction order allows ~2e-7)
# What VitScaleStrategy's setup prints once per fit (rank 0), and the repeated blocks it must have found and sharded
# in each example's default backbone (the pyramid's and head's repeated conv stacks aside). Checked here since
# 2026-11-28, on these runs, instead of on separate fast_dev_run fits in test_fast_dev_run.py.
SUMMARY = "VitScaleStrategy: 2 rank(s), precision 32-true"
BLOCKS = {"classification": {"Block": 4}, "detection": {"WindowBlock": 4}, "video": {"Block": 8}}

# task -> (extra CLI args that shrink the run for CI, metric column, threshold, vitscale-vs-ddp tolerance)
#
# Where the tolerances come from: vitscale and ddp see the same seed, data and initial weights and differ only in
# float reduction order (the parity tests: losses equal to ~2e-7 relative per step). A different seed (initial
# weights and data order) is a far larger perturbation, so its run-to-run spread bounds theirs. Classification,
# 12 epochs, vitscale, seeds 0 / 1 / 2: val_acc 0.958 / 0.955 / 0.961 (spread 0.006, i.e. 2 of 360 digits;
# `--seed_everything=N`, 2026-11-23): the 0.02 tolerance is ~3x that spread (kept for 6 epochs). Detection and
# video were not re-run per seed (~150 s per run under load): their 0.05 (13 of 256 video clips) is kept
# unmeasured. Since
# both read their generated data back from written files (COCO PNGs of varying size with flips and ViTDet's
# windowed attention; mp4 clips) the short CI runs measured, identical under both strategies epoch by epoch
# (2026-11-25), detection map_50 0.243 after 4 epochs on 1024 images, video val_acc 0.450 after 5 epochs.
#
# Shortened for CI on 2026-11-28 (163 s -> see the commit), each bar re-measured and set ~25% under the new value
# (seed 0, vitscale): classification 6 epochs, val_acc 0.164 / 0.419 / 0.696 / 0.808 / 0.878 / 0.873 (12 epochs:
# 0.958); detection 2 epochs on 1024 images, map_50 0.104 / 0.139 (3 epochs: 0.209, 4: 0.243; an epoch costs ~9 s).
# Video: writing and decoding the clips, not the epochs (~2-3 s each), was most of its time (2256 clips: 9.4 s to
# write, 5.1 s to decode on each rank of both runs), so it now writes 1000 training clips and takes batches of 8 per
# rank (62 steps an epoch, 4 epochs): val_acc 0.125 / 0.22 / 0.383 / 0.475, above the 5-epoch default's 0.450.
# Measured stuck at chance 0.125 (so not chosen): 3 epochs of 2000 clips at 32 per rank, also with 4-frame clips
# or lr 5e-3; 2 epochs at 16 per rank. The bar stays 0.35.
CASES = {
    # 10 classes, chance 0.10; digits are real data
    "classification": (["--trainer.max_epochs=6"], "val_acc", 0.65, 0.02),  # measured 0.873 (cosine over 6)
    # mAP@0.5 on generated shapes; chance (random boxes) is ~0.0
    "detection": (["--trainer.max_epochs=2", "--data.num_train=1024"], "map_50", 0.10, 0.05),  # measured 0.139
    # 8 motion directions, chance 0.125
    "video": (["--trainer.max_epochs=4", "--data.num_train=1000", "--data.batch_size=8"], "val_acc", 0.35, 0.05),
}  # video measured 0.475


def blocks_found(output: str) -> dict[str, int]:
    """The setup summary's ``blocks found : Block x4, ...`` line as a dict."""
    line = next(line for line in output.splitlines() if line.strip().startswith("blocks found"))
    found = [entry.rsplit(" x", 1) for entry in line.split(":", 1)[1].strip().split(", ") if " x" in entry]
    return {name: int(count) for name, count in found}


@pytest.mark.parametrize("task", sorted(CASES))
def test_converges_same_under_vitscale_and_ddp(task: str, tmp_path: Path) -> None:
    extra, metric, threshold, tol = CASES[task]
    runs = {}
    for strategy in ("vitscale", "ddp"):
        args = [f"--trainer.strategy={strategy}", *NO_CKPT, *EVERY_STEP, *extra,
                *(STOP_ORACLE if strategy == "ddp" else [])]
        if task != "classification":  # the generated default is written once as files; the second run reads them
            args.append(f"--data.cache_dir={tmp_path / 'cache'}")
        runs[strategy] = run_example(task, args, tmp_path / strategy, timeout=280).check()
    # the strategy each run was given: vitscale's setup summary once (fp32), naming the blocks it sharded; ddp: none
    assert runs["vitscale"].output.count(SUMMARY) == 1 and runs["ddp"].output.count("VitScaleStrategy:") == 0
    found = blocks_found(runs["vitscale"].output)
    assert {k: v for k, v in found.items() if k in BLOCKS[task]} == BLOCKS[task], found
    ours, oracle = runs["vitscale"].series(metric), runs["ddp"].series(metric)
    print(f"{task} {metric} per epoch: vitscale {ours}, ddp {oracle}")
    assert len(oracle) == ORACLE_EPOCHS < len(ours), (ours, oracle)
    assert ours[-1] >= threshold, f"{task} under vitscale: {metric}={ours[-1]:.3f} < {threshold}"
    for epoch, (a, b) in enumerate(zip(ours, oracle)):
        assert abs(a - b) <= tol, f"{task}, epoch {epoch}: vitscale {a:.3f} vs ddp {b:.3f} differ by more than {tol}"
    losses, oracle_losses = runs["vitscale"].series("train_loss"), runs["ddp"].series("train_loss")
    steps = len(oracle_losses)
    assert steps >= 16 and len(losses) == steps * len(ours), (len(losses), steps)  # one epoch of every step
    for step, (a, b) in enumerate(zip(losses, oracle_losses)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{task}, step {step}: vitscale loss {a} vs ddp {b}"
