"""Launch an example script as a user would (``python examples/<task>.py fit ...``), bounded in time."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU2 = ["--trainer.accelerator=cpu", "--trainer.devices=2"]


@dataclass
class Run:
    returncode: int
    output: str
    metrics_csv: Path

    def last(self, column: str) -> float:
        """Last logged value of ``column`` in the CSV logger's metrics.csv (i.e. the final epoch)."""
        rows = [r[column] for r in csv.DictReader(self.metrics_csv.open()) if r.get(column)]
        assert rows, f"no {column!r} in {self.metrics_csv}"
        return float(rows[-1])

    def check(self) -> Run:
        assert self.returncode == 0, f"exit {self.returncode}\n{self.output[-4000:]}"
        return self


def run_example(task: str, args: list[str], log_dir: Path, timeout: float) -> Run:
    """Run one example with the CSV logger pointed at ``log_dir``; kill the whole process group on timeout."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
    )
    cmd = [sys.executable, f"examples/{task}.py", "fit", *CPU2, f"--trainer.logger.init_args.save_dir={log_dir}", *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[killed after {timeout}s]"
    return Run(proc.returncode, out, log_dir / task / "version_0" / "metrics.csv")
