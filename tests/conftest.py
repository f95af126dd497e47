"""Shared pytest configuration: GPU tests skip cleanly without CUDA; under pytest-xdist the tests that launch
ranks run one at a time on one worker while the other worker takes the single-process tests."""

from __future__ import annotations

import pytest
import torch

_SERIAL = ("distributed", "slow", "gpu")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups off the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        # `-n 2 --dist loadgroup` (README's test command): a rank launch takes both cores and some bound their
        # time, so two never run at once; they share one worker, and the single-process tests fill the other core
        # (the launches leave about a quarter of it idle: 152% of 200% CPU measured over test_parity + test_ema).
        serial = pytest.mark.xdist_group("ranks")
        for item in items:
            if any(mark in item.keywords for mark in _SERIAL):
                item.add_marker(serial)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
