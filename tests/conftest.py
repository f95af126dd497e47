"""Shared pytest configuration: GPU tests skip cleanly without CUDA; README's ``-n 2 --dist loadfile`` deals out
whole files in collection order, the files sharing one launch as one."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.ports import free_port

# Files whose tests read one session-scoped launch (tests/examples/conftest.py's ``example_fits``): one worker runs
# them all, or each worker would pay the launch (~40 s) once.
SHARED_LAUNCH = {"tests/examples/test_backbones_and_pretraining.py": "example_fits",
                 "tests/examples/test_fast_dev_run.py": "example_fits"}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown (and never called) without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 (xdist's Scheduling, imported lazily)
    """Under ``--dist loadfile``: a file's tests (and its module-scoped launch) stay on one worker, as xdist's own
    scheduler does, and so do the files sharing a session-scoped launch. Files go out in collection order, not
    xdist's most-tests-first: tests/distributed and tests/examples, whose launches are long, start first, and the
    short unit tests fill the end. (``--dist loadgroup`` cannot group them: pytest 9 ignores the node id suffix
    pytest-xdist 3.8 adds.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedLaunchFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_LAUNCH.get(path, path)

    config.option.loadscopereorder = False
    return SharedLaunchFileScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _in_process_rendezvous_port() -> None:
    """The port of every in-process fit's TCPStore in this pytest process, reserved (tests/helpers/ports.py): left to
    Lightning it is drawn from the ephemeral range once and written to MASTER_PORT, and between two fits any other
    job's outgoing connection may take it. Launched ranks get their own (``rank_env`` drops this one)."""
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
