"""The README's main-job command works and shows what it promises."""

from __future__ import annotations

import re

import pytest

from tests.helpers.launch import assert_ok, python_command, run_bounded

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def test_demo_prints_matching_losses_and_half_the_bytes():
    # as typed, forked from the test zygote like every launch (the rank Lightning starts too): not ~10 s of imports
    cmd, env = python_command("-m", "lightning_vitscale", "demo", "--steps", "4")
    result = run_bounded(cmd, 200, env)
    assert_ok(result)
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", result.output, flags=re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert all(float(r[3]) < 1e-5 for r in rows)
    ratios = [float(x) for x in re.findall(r"\((\d\.\d\d)x\)$", result.output, flags=re.M)]
    assert len(ratios) == 2 and all(r <= 0.55 for r in ratios)


def test_cli_rejects_unknown_precision(capsys):
    from lightning_vitscale.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--precision", "fp8"])
    assert exit_info.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
