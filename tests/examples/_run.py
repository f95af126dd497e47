"""Launch an example script as a user would (``python examples/<task>.py fit ...``), bounded in time."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.launch import python_command, run_bounded

CPU2 = ["--trainer.accelerator=cpu", "--trainer.devices=2"]


@dataclass
class Run:
    returncode: int
    output: str
    metrics_csv: Path

    def last(self, column: str) -> float:
        """Last logged value of ``column`` in the CSV logger's metrics.csv (i.e. the final epoch)."""
        return self.series(column)[-1]

    def series(self, column: str) -> list[float]:
        """Every logged value of ``column``, in order (one per epoch for the epoch-level validation metrics)."""
        values = [float(r[column]) for r in csv.DictReader(self.metrics_csv.open()) if r.get(column)]
        assert values, f"no {column!r} in {self.metrics_csv}"
        return values

    def check(self) -> Run:
        assert self.returncode == 0, f"exit {self.returncode}\n{self.output[-4000:]}"
        return self


def run_example(task: str, args: list[str], log_dir: Path, timeout: float) -> Run:
    """Run one example with the CSV logger pointed at ``log_dir``; the shared launcher bounds it in time."""
    log = f"--trainer.logger.init_args.save_dir={log_dir}"
    cmd, env = python_command(f"examples/{task}.py", "fit", *CPU2, log, *args)
    result = run_bounded(cmd, timeout, env)
    output = result.output + (f"\n[killed after {timeout}s]" if result.timed_out else "")
    return Run(result.returncode, output, log_dir / task / "version_0" / "metrics.csv")
