"""Each GPU test starts from an empty allocator: what an earlier test left (reference cycles through FSDP's hooks
wait for the garbage collector; a failed test's frames keep its model alive) must not count in this test's memory
measurements or caps. Seen on the first H200 run: 9.6 GiB left by the planner's cases made the offload test's
700 MiB cap fail at setup, and each planner case measured its predecessors too."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def empty_allocator() -> Iterator[None]:
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One line per test as soon as it ends: outcome, seconds and why it failed. benchmarks/gpu_run.sh runs these
    tests under a time limit, and pytest prints failures only at the end: twice (H200 run 3, H100 run 4) the part was
    killed first and a failure's message was lost. benchmarks/gpu_report.py reads these lines from the log."""
    if not report.nodeid.startswith("tests/gpu/"):  # the hook sees every test of the run (all of them under -n)
        return
    if report.when == "call" or report.outcome != "passed":
        message = ""
        if report.outcome != "passed":
            crash = getattr(report.longrepr, "reprcrash", None)  # what JUnit's message says; absent for skips
            text = crash.message if crash is not None else report.longreprtext
            message = next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]
        print(f"\n{EARLY_REPORT} {report.nodeid} {report.outcome} {report.duration:.1f}s {message}".rstrip(),
              file=sys.stderr, flush=True)


EARLY_REPORT = "GPU-TEST-REPORT"  # the prefix gpu_report.py looks for
