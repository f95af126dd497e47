"""Merge what ``gpu_run.sh``'s parts wrote into the files that come back from a GPU machine.

Usage (gpu_run.sh calls it last, whatever happened before)::

    python benchmarks/gpu_report.py --work WORK_DIR --out OUT_DIR --command "bash benchmarks/gpu_run.sh ..."

Writes ``OUT_DIR/gpu_results.json`` (every number: environment, parts, tests, trials), ``OUT_DIR/gpu_results.md``
(the section for benchmarks/RESULTS.md: device, versions, command, tables) and ``OUT_DIR/gpu_throughput.png``.
A part cut short by its timeout leaves its trials in ``vit_gpu_trials.jsonl`` (written as each trial ends):
the tables are rebuilt from there, and say so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.search import OK  # noqa: E402
from benchmarks.tables import MFU_FORMULA, fmt, markdown_table  # noqa: E402

THROUGHPUT_PARTS = {  # gpu_run.sh's --stem of each vit_gpu.py call, in report order, and how its tables read
    "vit_h14": "",
    "cap40": " at a 40 GB cap per process (torch.cuda.set_per_process_memory_fraction: the A100-40GB regime)",
    "vit_b16": "",
}
VITSCALE = ("default", "recipe", "eager_ac0", "eager_ac1", "auto_ac0", "auto_ac1", "auto_acplan")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pytest_rows(path: Path) -> list[dict]:
    """One row per test case of a JUnit XML report: outcome, seconds, and the first line of any message."""
    if not path.is_file():
        return []
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or found.text or "").strip().splitlines()[0][:200] if (
                    found.get("message") or found.text) else ""
                break
        rows.append(dict(test=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
                         seconds=float(case.get("time") or 0), message=message))
    return rows


def pytest_rows_from_log(path: Path) -> list[dict]:
    """When the part was killed before pytest wrote its XML report: the line tests/gpu/conftest.py prints as each
    test ends (``GPU-TEST-REPORT nodeid outcome 12.3s message``), else the outcome lines ``pytest -v`` printed."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines()
    early = re.compile(r"^GPU-TEST-REPORT (tests/gpu/\S+::\S+) (passed|failed|skipped) ([0-9.]+)s ?(.*)$")
    rows = [dict(test=_test_name(m.group(1)), outcome=m.group(2), seconds=float(m.group(3)),
                 message=m.group(4)[:200] or "from the log: pytest was stopped before its report")
            for line in lines if (m := early.match(line))]
    if rows:
        return rows
    verbose = re.compile(r"^(tests/gpu/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)")
    return [dict(test=_test_name(m.group(1)), outcome=m.group(2).lower(), seconds=0.0,
                 message="from the log: pytest was stopped before its report")
            for line in lines if (m := verbose.match(line))]


def _test_name(node_id: str) -> str:
    """``tests/gpu/x.py::test`` as the JUnit report names it (``tests.gpu.x::test``)."""
    return node_id.replace("/", ".").replace(".py::", "::")


def throughput(work: Path, stem: str, log: list[dict]) -> dict | None:
    """A vit_gpu.py call's results: its JSON, or (cut short) its trials from the log."""
    results = read_json(work / f"{stem}.json")
    if results is not None:
        return results
    rows = [r for r in log if r.get("stem") == stem]
    if not rows:
        return None
    same = [r for r in rows if r.get("table") == "same"]
    largest = [dict(r["largest"], model=r["model"], row=r["row"], stopped_by="cut short", trials=[
        (r["largest"].get("batch"), r["largest"]["status"])], predicted_largest=(r["largest"].get("fit") or {}).get(
        "unbounded")) for r in same if r.get("largest")]
    return dict(same=same, largest=largest, cut_short=True, skipped={})


def header(env: dict | None, command: str) -> str:
    if env is None:
        when = time.strftime("%Y-%m-%d %H:%M")
        return f"### {when} — environment unknown (its part failed)\n\nCommand: `{command}`\n"
    device, versions, matmul = env.get("device", {}), env.get("versions", {}), env.get("matmul", {})
    smi = env.get("nvidia_smi")
    driver = smi.get("driver_version") if isinstance(smi, dict) else smi
    memory = f", {device['memory_gib']:.1f} GiB" if device.get("memory_gib") else ""
    peak = env.get("datasheet_dense_bf16_tflops")
    probe = f"{matmul.get('n')}^3 {matmul.get('dtype')} matmul: {matmul.get('tflops', 0):.0f} TFLOP/s"
    if peak:
        probe += f" ({matmul['tflops'] / peak:.0%} of the {peak:.0f} TFLOP/s datasheet dense bf16 peak)"
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    return (f"### {time.strftime('%Y-%m-%d %H:%M')} — {device.get('name', '?')}{memory}\n\n"
            f"Driver {driver}; {shown}. {env.get('cpus')} CPUs.\n\n"
            f"Command: `{command}`. {probe}.\n\n{MFU_FORMULA}\n")


def parts_table(parts: list[dict]) -> str:
    body = [[p["part"], p["status"], p.get("rc"), fmt(p.get("seconds"), ".0f")] for p in parts]
    return markdown_table(["part", "status", "exit code", "seconds"], body)


def tests_table(rows: list[dict]) -> str:
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "error", "skipped")}
    summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no test ran"
    body = [[r["test"].removeprefix("tests.gpu."), r["outcome"], f"{r['seconds']:.1f}", r["message"][:120]]
            for r in rows]
    return f"`pytest -m gpu tests/gpu`: {summary}.\n\n" + markdown_table(["test", "outcome", "s", "message"], body)


NO_PLOT = ("No `gpu_throughput.png`: matplotlib is not installed here"
           " (`pip install 'lightning-vitscale[benchmarks]'`); every number is in the tables above.")


def plot(results: dict[str, dict], path: Path) -> bool:
    """Images/s per row: the same batch (left), each row's largest batch (right), a bar group per model.

    Returns False without matplotlib (CI's dry run installs only the test extras): a missing
    plotting library must not cost the numbers a GPU lease measured.
    """
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.vit_gpu import ROWS

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, table, title in zip(axes, ("same", "largest"), ("same batch per model", "each row's largest batch")):
        rows = [r for res in results.values() for r in res.get(table, []) if r.get("status") == OK]
        models = list(dict.fromkeys(r["model"] for r in rows))
        keys = list(dict.fromkeys(r["row"] for r in rows))
        width = 0.8 / max(len(keys), 1)
        for i, key in enumerate(keys):
            found = {r["model"]: r for r in rows if r["row"] == key}
            xs = [j + i * width for j, m in enumerate(models) if m in found]
            ys = [found[m]["images_per_sec"] for m in models if m in found]
            ax.bar(xs, ys, width, label=ROWS[key].label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
        ax.set_title(title)
        ax.set_ylabel("images/s (median over windows)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _phase_ips(results: dict, stem: str, row: str, batch: int | None = None) -> float | None:
    """Images/s of ``row`` in a part's same-batch table at ``batch`` (``None``: its largest-batch row)."""
    part = results.get(stem) or {}
    trials = part.get("largest" if batch is None else "same", [])
    for trial in trials:
        if trial.get("row") != row or trial.get("status") != OK:
            continue
        if batch is None:
            return trial.get("images_per_sec")
        return next((p["images_per_sec"] for p in trial["phases"] if p["batch"] == batch), None)
    return None


def acceptance(results: dict) -> list[str]:
    """Issue 47's GPU targets, each PASS, FAIL or not measured, from this run's tables."""
    lines = []

    def check(what: str, value: float | None, target: float, unit: str = "x") -> None:
        shown = "not measured" if value is None else (
            f"{'PASS' if value >= target else 'FAIL'}: {value:.2f}{unit}" if unit == "x" else
            f"{'PASS' if value >= target else 'FAIL'}: {value:.1%}")
        goal = f">= {target:.2f}x" if unit == "x" else f">= {target:.0%}"
        lines.append(f"- {what} ({goal}): {shown}")

    def ratio(stem: str, row: str, batch: int | None) -> float | None:
        a, b = _phase_ips(results, stem, row, batch), _phase_ips(results, stem, "single", batch)
        return a / b if a and b else None

    for batch in (32, 64):
        check(f"ViT-H/14 batch {batch}: VitScaleStrategy() / plain AMP O1", ratio("vit_h14", "default", batch), 1.0)
    check("ViT-B/16 batch 128: VitScaleStrategy() / plain AMP O1", ratio("vit_b16", "default", 128), 0.97)
    capped = [(r, ratio("cap40", r, None)) for r in ("default", "recipe")]
    best = max((c for c in capped if c[1] is not None), key=lambda c: c[1], default=(None, None))
    check(f"40 GB cap, each at its largest batch: best VitScale row ({best[0]}) / plain AMP O1", best[1], 1.3)
    mfus = [(t["row"], t.get("mfu")) for t in (results.get("vit_h14") or {}).get("largest", [])
            if t.get("row") in VITSCALE and t.get("status") == OK and t.get("mfu") is not None]
    top = max(mfus, key=lambda m: m[1], default=(None, None))
    check(f"ViT-H/14 MFU at the largest batch, best VitScale row ({top[0]})", top[1], 0.45, unit="%")
    return lines


def model_table(results: dict) -> str:
    """The planner's whole-step model against this run's rows (``benchmarks/throughput_model.py``)."""
    from benchmarks import throughput_model

    rows = throughput_model.measured_rows({"throughput": results}, "this run")
    return throughput_model.table(throughput_model.errors(rows))


def profile_table(profile: list[dict]) -> str:
    """Per profiled row: host and kernel time per step, launches, and host time by kind (``gpu_profile.py``)."""
    kinds = sorted({k for r in profile for k in r.get("host_by_kind", {})})
    body = [[r["row"], r.get("batch"), fmt(r.get("host_ms_per_step"), ".1f"), fmt(r.get("kernel_ms_per_step"), ".1f"),
             fmt(r.get("kernels_per_step"), ".0f"), *[fmt(r.get("host_by_kind", {}).get(k), ".1f") for k in kinds]]
            if "error" not in r else [r["row"], None, None, None, None, *[None] * len(kinds)] for r in profile]
    return markdown_table(["row", "batch", "host ms/step (profiled)", "kernel ms/step", "kernels/step",
                           *[f"{k} ms" for k in kinds]], body)


def report(work: Path, out: Path, command: str) -> dict:
    from benchmarks.vit_gpu import largest_table, planner_table, same_batch_table

    env = read_json(work / "env.json")
    parts = read_jsonl(work / "parts.jsonl")
    log = read_jsonl(work / "vit_gpu_trials.jsonl")
    tests = pytest_rows(work / "pytest.xml") or pytest_rows_from_log(out / "gpu_run.log")
    results = {stem: res for stem in THROUGHPUT_PARTS if (res := throughput(work, stem, log)) is not None}
    planner = read_json(work / "planner.json") or (
        {"planner": [r for r in log if r.get("stem") == "planner"], "cut_short": True} if log else None)
    text = [header(env, command), "Parts (each under its own timeout; a failure is a row, never the end):\n",
            parts_table(parts)]
    text.append("Issue 47's GPU targets:\n\n" + "\n".join(acceptance(results)) + "\n")
    for stem, res in results.items():
        note = THROUGHPUT_PARTS[stem] + (" (cut short by its timeout: rebuilt from the trial log)"
                                         if res.get("cut_short") else "")
        if res.get("same") and stem != "cap40":
            text.append(f"Throughput, same batch for every row{note}:\n\n"
                        + same_batch_table(res["same"], res.get("skipped", {})))
        if res.get("largest"):
            text.append(f"Each row at its largest batch{note}:\n\n" + largest_table(res["largest"]))
    if results:
        text.append("The planner's whole-step model against these rows (predicted; `benchmarks/throughput_model.py`):"
                    "\n\n" + model_table(results))
    profile = read_json(work / "profile.json")
    if profile:
        text.append("Where ViT-B/16's step spends its host time (`gpu_profile.py`, torch.profiler, so inflated):\n\n"
                    + profile_table(profile))
    if planner and planner.get("planner"):
        text.append("The planner's predicted peak against `torch.cuda.max_memory_allocated` over the timed steps"
                    " (Trainer.fit, `example_input_array` set, `kernels='eager'`):\n\n"
                    + planner_table(planner["planner"]))
    host = read_json(work / "host.json")
    if host:
        from benchmarks.host_overhead import table as host_table

        text.append("Host time per step, ViT-H's 32 blocks at width 64 (`benchmarks/host_overhead.py`: the CPU side of"
                    " a step, no arithmetic to hide it):\n\n" + host_table(host))
    text.append(tests_table(tests))
    merged = dict(env=env, parts=parts, throughput=results, planner=planner, host=host, profile=profile, tests=tests,
                  command=command)
    out.mkdir(parents=True, exist_ok=True)
    if any(res.get("same") for res in results.values()) and not plot(results, out / "gpu_throughput.png"):
        text.append(NO_PLOT)
    (out / "gpu_results.json").write_text(json.dumps(merged, indent=1, default=str))
    (out / "gpu_results.md").write_text("\n".join(text))
    print("\n".join(text))
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", default="bash benchmarks/gpu_run.sh")
    args = parser.parse_args()
    report(args.work, args.out, args.command)


if __name__ == "__main__":
    main()
