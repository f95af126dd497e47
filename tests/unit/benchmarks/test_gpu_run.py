"""The one-call GPU run's pieces on CPU: the largest-batch fit, a trial's phases (kept when it is killed), and the
report built from whatever the parts left."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from benchmarks import gpu_report, vit_gpu
from benchmarks.search import OK, OOM, fit_largest, step_down


def test_the_fit_extrapolates_the_two_peaks_to_the_memory_fraction():
    fit = fit_largest([(64, 33.0), (32, 21.0)], memory_gib=140.0, fraction=0.85, granularity=8, limit=1024)
    # slope (33 - 21) / 32 = 0.375 GiB per sample, base 9 GiB: (119 - 9) / 0.375 = 293.3 -> 288 (multiple of 8)
    assert (fit.per_sample_gib, fit.base_gib, fit.unbounded, fit.batch, fit.bound) == (0.375, 9.0, 293, 288, "memory")
    capped = fit_largest([(32, 21.0), (64, 33.0)], 140.0, 0.85, 8, limit=256)
    assert (capped.batch, capped.unbounded, capped.bound) == (256, 293, "limit")
    flat = fit_largest([(32, 12.11), (64, 12.11)], 140.0, 0.85, 8, limit=512)  # peak in the optimizer step
    assert (flat.batch, flat.unbounded, flat.bound) == (512, None, "limit")
    with pytest.raises(ValueError, match="two different batches"):
        fit_largest([(32, 1.0), (32, 2.0)], 140.0, 0.85, 8, 512)


def test_stepping_down_after_an_oom_always_shrinks_and_ends():
    assert (step_down(296, 8), step_down(10, 1), step_down(9, 8), step_down(8, 8)) == (232, 8, 0, 0)
    sizes, batch = [], 296
    while batch:
        sizes.append(batch)
        batch = step_down(batch, 8)
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert all(size % 8 == 0 for size in sizes) and sizes[-1] == 8


def _spec(**changes):
    spec = dict(model=vit_gpu.DRY_MODEL, row=vit_gpu.asdict(vit_gpu.ROWS["single"]), batch=2, batches=[2, 3], steps=1,
                windows=2, warmup=1, device="cpu", fake_memory=[1.0, 0.25, 4.0],
                largest=dict(memory_fraction=0.9, granularity=1, limit=16, warmup=1, steps=1, windows=2))
    return {**spec, **changes}


def _trial(spec):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vit_gpu.trial(spec)


def test_a_trial_goes_on_at_the_batch_its_two_phases_extrapolate_to():
    result = _trial(_spec())
    assert result["status"] == OK and [p["batch"] for p in result["phases"]] == [2, 3]
    assert [p["peak_allocated_gib"] for p in result["phases"]] == [1.5, 1.75]  # the stand-in memory
    largest = result["largest"]
    assert (largest["status"], largest["batch"], largest["fit"]["unbounded"]) == (OK, 10, 10)  # (3.6 - 1) / 0.25
    assert len(largest["window_seconds"]) == 2


def test_an_oom_at_the_largest_batch_keeps_the_measured_phases():
    result = _trial(_spec(fake_oom_above=6))
    assert result["status"] == OK and len(result["phases"]) == 2
    assert (result["largest"]["status"], result["largest"]["batch"]) == (OOM, 10)
    assert _trial(_spec(fake_oom_above=2))["status"] == OOM  # phase 2 itself does not fit: the trial failed


def test_a_killed_trial_keeps_the_phases_it_finished():
    phase = dict(batch=2, window_seconds=[0.1, 0.1], peak_allocated_gib=1.5, peak_reserved_gib=None)
    stdout = "noise\nPHASE " + json.dumps(phase) + "\nPHASE " + json.dumps(dict(phase, batch=3)) + "\n"
    result = vit_gpu.partial_result(stdout, _spec(), "no result after 5 s")
    assert result["status"] == OK and [p["batch"] for p in result["phases"]] == [2, 3]
    assert result["largest"]["status"] == "timeout"
    assert vit_gpu.partial_result("PHASE " + json.dumps(phase), _spec(), "late")["status"] == "timeout"


def _cut_short_run(tmp_path: Path) -> tuple[Path, Path]:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "parts.jsonl").write_text(json.dumps(dict(part="vit_h14", status="timeout after 240s", rc=124,
                                                      seconds=240)) + "\n")
    row = _trial(_spec())
    row.update(model="vit-dry", row="single", batch=2, table="same", stem="vit_h14")
    for phase in (*row["phases"], row["largest"]):
        vit_gpu.summarize_phase(phase, 1, 1e9, None)
    row.update({k: v for k, v in row["phases"][0].items() if k != "batch"})
    (work / "vit_gpu_trials.jsonl").write_text(json.dumps(row) + "\n")
    host = {"single AMP O1": 50.0, "VitScaleStrategy(activation_checkpointing=False)": 80.0,
            "VitScaleStrategy()": 115.0}
    (work / "host.json").write_text(json.dumps({"accelerator": "cuda", "rounds": 2, "ms_per_step": host}))
    (out).mkdir()
    (out / "gpu_run.log").write_text("tests/gpu/test_a.py::test_b PASSED [ 50%]\n"
                                     "tests/gpu/test_a.py::test_c FAILED [100%]\n")
    return work, out


def test_the_report_reads_what_a_cut_short_run_left(tmp_path: Path):
    work, out = _cut_short_run(tmp_path)
    merged = gpu_report.report(work, out, "bash benchmarks/gpu_run.sh OUT")
    text = (out / "gpu_results.md").read_text()
    assert "cut short by its timeout" in text and "| vit_h14 | timeout after 240s | 124 | 240 |" in text
    assert merged["throughput"]["vit_h14"]["largest"][0]["batch"] == 10
    assert "| VitScaleStrategy(activation_checkpointing=False) | 80.0 | 1.60x |" in text  # the host part's table
    assert [(t["test"], t["outcome"]) for t in merged["tests"]] == [
        ("tests.gpu.test_a::test_b", "passed"), ("tests.gpu.test_a::test_c", "failed")]
    if importlib.util.find_spec("matplotlib") is None:  # CI installs only the test extras
        assert gpu_report.NO_PLOT in text and not (out / "gpu_throughput.png").exists()
    else:
        assert (out / "gpu_throughput.png").stat().st_size > 0 and gpu_report.NO_PLOT not in text


def test_without_matplotlib_the_report_keeps_every_number_and_says_why_no_png(tmp_path: Path, monkeypatch):
    work, out = _cut_short_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    merged = gpu_report.report(work, out, "bash benchmarks/gpu_run.sh OUT")
    assert gpu_report.NO_PLOT in (out / "gpu_results.md").read_text()
    assert not (out / "gpu_throughput.png").exists()
    assert json.loads((out / "gpu_results.json").read_text())["throughput"] == json.loads(
        json.dumps(merged["throughput"], default=str))


def test_junit_outcomes_and_messages(tmp_path: Path):
    xml = tmp_path / "pytest.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_x" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.gpu.test_x" name="test_bad" time="0.2">'
        '<failure message="AssertionError: 3 != 2">trace</failure></testcase>'
        '<testcase classname="tests.gpu.test_x" name="test_skip" time="0">'
        '<skipped message="needs xformers"/></testcase>'
        "</testsuite></testsuites>"
    )
    rows = gpu_report.pytest_rows(xml)
    assert [(r["outcome"], r["message"]) for r in rows] == [
        ("passed", ""), ("failed", "AssertionError: 3 != 2"), ("skipped", "needs xformers")]
    assert rows[0]["seconds"] == 1.5


def test_a_killed_pytest_part_keeps_each_finished_tests_outcome_seconds_and_failure(tmp_path: Path):
    """tests/gpu/conftest.py prints a line as each test ends; the report reads them when pytest never reached its
    summary (H100 run 4: the part was killed during the last test, and the planner failure's message was lost)."""
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    (gpu / "conftest.py").write_text((Path(__file__).parents[2] / "gpu" / "conftest.py").read_text())
    (gpu / "test_x.py").write_text(
        "import time\n"
        "def test_ok():\n    time.sleep(0.2)\n"
        "def test_bad():\n    ratio = 1.159\n    assert ratio <= 1.15, f'predicted/measured = {ratio}'\n"
        "def test_killed():\n    import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    log = tmp_path / "gpu_run.log"
    with log.open("w") as sink:  # as gpu_run.sh runs it: stdout and stderr into one log, -v
        subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/gpu"], cwd=tmp_path,
                       stdout=sink, stderr=subprocess.STDOUT, timeout=120, check=False)
    rows = gpu_report.pytest_rows_from_log(log)
    assert [(r["test"], r["outcome"]) for r in rows] == [
        ("tests.gpu.test_x::test_ok", "passed"), ("tests.gpu.test_x::test_bad", "failed")]
    assert rows[0]["seconds"] >= 0.2
    assert "predicted/measured = 1.159" in rows[1]["message"]


def test_a_capped_trial_fits_its_largest_batch_to_the_cap():
    """``--memory-cap-gib``: the largest-batch fit aims at the cap (the dry run's 4 GiB stand-in capped at 3)."""
    result = _trial(_spec(memory_cap_gib=3.0))
    assert result["memory_cap_gib"] == 3.0 and result["device_memory_gib"] == 3.0
    assert result["largest"]["fit"]["unbounded"] == 6  # (0.9 x 3 - 1) / 0.25, where 4 GiB gave 10


def _trials(row: str, same: dict[int, float], largest: float | None = None, mfu: float | None = None) -> dict:
    phases = [dict(batch=b, images_per_sec=ips) for b, ips in same.items()]
    trial = dict(row=row, status=OK, phases=phases)
    return dict(same=[trial], largest=[dict(row=row, status=OK, images_per_sec=largest, mfu=mfu)] if largest else [])


def test_the_report_checks_issue_47s_gpu_targets():
    def part(*trials: dict) -> dict:
        return {"same": [t for x in trials for t in x["same"]], "largest": [t for x in trials for t in x["largest"]]}

    results = {
        "vit_h14": part(_trials("single", {32: 300, 64: 340}, 377, 0.38),
                        _trials("default", {32: 310, 64: 330}, 440, 0.46)),
        "cap40": part(_trials("single", {32: 1}, 300), _trials("recipe", {32: 1}, 420),
                      _trials("default", {32: 1}, 360)),
        "vit_b16": part(_trials("single", {128: 2500}), _trials("default", {128: 2400})),
    }
    lines = gpu_report.acceptance(results)
    assert lines == [
        "- ViT-H/14 batch 32: VitScaleStrategy() / plain AMP O1 (>= 1.00x): PASS: 1.03x",
        "- ViT-H/14 batch 64: VitScaleStrategy() / plain AMP O1 (>= 1.00x): FAIL: 0.97x",
        "- ViT-B/16 batch 128: VitScaleStrategy() / plain AMP O1 (>= 0.97x): FAIL: 0.96x",
        "- 40 GB cap, each at its largest batch: best VitScale row (recipe) / plain AMP O1 (>= 1.30x): PASS: 1.40x",
        "- ViT-H/14 MFU at the largest batch, best VitScale row (default) (>= 45%): PASS: 46.0%",
    ]
    assert all("not measured" in line for line in gpu_report.acceptance({}))
