"""Fault injection through ``Trainer.fit`` on 2 gloo ranks: one rank SIGKILLed while writing part of its shard of
a synchronous save (rank 0: the rank that commits, and Lightning's launching process), of an asynchronous save
(rank 1, in the background while the next step trains), and between two steps (rank 1). Each job must end soon
after the kill, every rank with it. Resuming each folder with
``ckpt_path="last"`` and ``auto_resume=True``, on the same 2 ranks and on 1, must restore exactly the weights,
optimizer state and step recorded when the last complete save began, skipping the partial one with a log line
saying why; every earlier complete checkpoint must still load. A flipped byte and a truncated shard in the newest
checkpoint make ``"last"``/``auto_resume`` fall back to the previous complete one, naming the file, and an
explicit ``ckpt_path`` to it raise a ``CheckpointError`` naming the file.

Launches: one per kill (Lightning's own launcher, so the strategy's failure teardown runs) and one resume run on 2
ranks and one on 1, each checking every scenario in one process. (The 1-rank resumes once ran in the test process:
a later in-process test, the DINO example's, then took 86 s instead of 43.) The three kills run at the same time
(each its own folder, port and job), then the two resumes (they only read the folders the kills left: each writes
its own ``restored-<n>`` and ``damaged-*-<n>``): ~17 s instead of ~26 s one after the other."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lightning_vitscale.checkpoint import load_consolidated
from lightning_vitscale.checkpoint.storage import SHARDED_MARKER
from tests.distributed.scripts.fault_injection import SCENARIOS
from tests.helpers.launch import assert_ok, lightning_launch, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
SCRIPT = "tests/distributed/scripts/fault_injection.py"
# Every rank of a job with a dead rank ends within this (gloo fails a collective with a dead peer at once; the
# longest wait on the way is the strategy's 30 s notice grace, which a rank that noticed never takes).
ENDED_WITHIN_S = 25
NEVER_COMMITTED = "no readable lightning_vitscale.json: its save never completed"

# Per scenario: the step each resume must restore (the last complete save it may pick), and the interrupted
# folder, which the resume must skip with a log line, or None (killed between steps: nothing interrupted).
# "last" considers last.ckpt only; auto_resume every checkpoint in the folder, the newest complete one winning.
EXPECTED = {
    "sync-r0": {"last": 4, "auto": 6, "partial": "last.ckpt.partial"},
    "async-r1": {"last": 2, "auto": 4, "partial": "last.ckpt.partial"},
    "between-r1": {"last": 4, "auto": 4, "partial": None},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")

    def kill(name: str):
        return lightning_launch(SCRIPT, "kill", name, str(out), timeout=150), time.time()

    def resume(devices: int):
        return torchrun(SCRIPT, "resume", str(devices), str(out), nprocs=devices, timeout=300)

    with ThreadPoolExecutor(max_workers=len(SCENARIOS)) as pool:
        killed = dict(zip(SCENARIOS, pool.map(kill, SCENARIOS)))
        for resumed in pool.map(resume, (2, 1)):
            assert_ok(resumed)
    return out, killed, {n: json.loads((out / f"resume{n}-rank0.json").read_text()) for n in (2, 1)}


def state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_state(restored: Path, saved: Path) -> None:
    a, b = state(restored), state(saved)
    assert a.keys() == b.keys() and len(a) > 20
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_rank_killed_ends_the_job_in_bounded_time(run, scenario):
    out, killed, _ = run
    (result, ended), kill = killed[scenario], SCENARIOS[scenario]
    assert not result.timed_out, result.output[-4000:]  # every rank ended: the launcher's pipe closed
    assert result.returncode != 0, result.output[-4000:]
    assert not list((out / scenario).glob("survived-rank*")), "the kill never happened"
    after_kill = ended - float((out / scenario / "killed").read_text())
    assert 0 < after_kill < ENDED_WITHIN_S, f"the job ended {after_kill:.0f}s after the kill"
    assert (out / scenario / "saved" / f"step{kill.step - kill.step % 2}.pt").exists()
    partial = EXPECTED[scenario]["partial"]
    if partial is not None:  # it died after writing part of its shard: the folder exists, never committed
        folder = out / scenario / "ckpts" / partial
        assert list(folder.glob(f"__{kill.rank}_*.distcp")) and not (folder / SHARDED_MARKER).exists()


@pytest.mark.parametrize("devices", [2, 1])
@pytest.mark.parametrize("how", ["last", "auto"])
def test_resume_restores_the_last_complete_save_and_says_what_it_skipped(run, devices, how):
    out, _, resumed = run
    for scenario, expected in EXPECTED.items():
        facts = resumed[devices][f"{scenario}-{how}"]
        assert facts["error"] is None, (scenario, facts)
        saved = out / scenario / "saved" / f"step{expected[how]}.pt"
        assert_same_state(out / f"restored-{devices}" / f"{scenario}-{how}.pt", saved)
        skipped = [line for line in facts["lines"] if "skipped" in line]
        partial = expected["partial"]
        if partial is not None:  # also under "last": the folder's other saves are its fallbacks, checked too
            assert any(f"/{partial}: {NEVER_COMMITTED}" in line for line in skipped), (scenario, facts["lines"])
        else:
            assert not skipped, (scenario, skipped)


def test_every_earlier_complete_checkpoint_still_loads_with_its_saved_weights(run):
    out, _, _ = run
    checked = 0
    for scenario in SCENARIOS:
        for folder in sorted((out / scenario / "ckpts").glob("step=*.ckpt")):
            step = int(folder.name[len("step="):-len(".ckpt")])
            saved = state(out / scenario / "saved" / f"step{step}.pt")
            loaded = load_consolidated(folder)
            assert loaded["global_step"] == step == int(saved["global_step"])
            weights = {k[len("w."):]: v for k, v in saved.items() if k.startswith("w.")}
            assert weights.keys() == loaded["state_dict"].keys()
            assert all(torch.equal(v, loaded["state_dict"][k]) for k, v in weights.items()), (scenario, step)
            checked += 1
    assert checked == 3 + 2 + 2  # sync-r0 committed step=6.ckpt before it died writing last.ckpt


@pytest.mark.parametrize("devices", [2, 1])
@pytest.mark.parametrize(
    "damage, message, explicit_message",
    [("flip", "fails its CRC-32 check", "fails its CRC-32 check"), ("truncate", "bytes, its save wrote", "truncated")],
)
def test_a_damaged_shard_falls_back_to_the_previous_complete_save_or_raises_naming_it(
    run, devices, damage, message, explicit_message
):
    out, _, resumed = run
    facts = resumed[devices]
    victim = facts[f"{damage}-shard"]
    for how in ("last", "auto"):  # the newest (step 6) and last.ckpt (step 4) damaged: step=4.ckpt is next
        resumed_from = facts[f"{damage}-{how}"]
        assert resumed_from["error"] is None, resumed_from
        assert_same_state(out / f"restored-{devices}" / f"{damage}-{how}.pt", out / "sync-r0" / "saved" / "step4.pt")
        assert any(victim in line and message in line for line in resumed_from["lines"]), resumed_from["lines"]
    explicit = facts[f"{damage}-path"]["error"]
    assert explicit is not None and victim in explicit and explicit_message in explicit, explicit
