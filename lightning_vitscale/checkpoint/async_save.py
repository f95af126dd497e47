"""Asynchronous sharded saves (torchtitan's ``async_mode``): the step pays only the copy of this rank's shards
into host memory; DCP writes from a background thread, one save in flight at most, committed once every rank wrote,
a failure raised on every rank at the next training step. Background collectives use a gloo group of their own:
two threads must never issue collectives on one group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_vitscale.checkpoint.errors import AsyncSaveError
from lightning_vitscale.checkpoint.storage import Location

Gather = Callable[[Any], list[Any]]  # every rank's object, on every rank (a collective)


class AsyncSaves:
    """One rank's asynchronous saves: the background thread, its process group and the save in flight."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: Future[None] | None = None  # the background thread's hash-and-commit

    def start(
        self, tensors: dict[str, Any], staging: Location, location: Location, finish: Callable[[Any, Gather], None],
        planner: Any = None,
    ) -> None:
        """Stage ``tensors`` in host memory now, write them into ``staging`` in the background, then run
        ``finish(dcp_metadata, gather)`` on every rank once all wrote (``gather`` on the background group)."""
        self.wait()
        group = self._side_group()
        upload = dcp.async_save(tensors, storage_writer=staging.writer(), process_group=group, planner=planner)
        if not isinstance(upload, Future):  # a stager that copies in the background: wait for the write
            upload = upload.upload_completion
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitscale-async-save")
        self._in_flight = self._executor.submit(_finish, upload, finish, group, location)

    def raise_if_failed(self) -> None:
        """Raise a finished save's failure (not blocking: a save still writing is left alone)."""
        if self._in_flight is not None and self._in_flight.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is committed (or raise its failure); then none is in flight."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        """Wait for the save in flight without raising (the caller may be handling an error), stop the thread."""
        with contextlib.suppress(AsyncSaveError):
            self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor = None

    def _side_group(self) -> dist.ProcessGroup | None:
        if self._group is None and dist.is_initialized():
            # A collective: every rank saves at the same point, so every rank makes it here together.
            group = dist.new_group(backend="gloo", timeout=self.timeout)
            self._group = group if isinstance(group, dist.ProcessGroup) else None
        return self._group


def _finish(upload: Future[Any], finish: Callable[[Any, Gather], None], group: Any, location: Location) -> None:
    """Background thread: wait for this rank's write, agree with every rank, then hash and commit, agree again."""
    failures = _exchange(_outcome(upload.result), group)
    if not failures:
        failures = _exchange(_outcome(lambda: finish(upload.result(), partial(_gather, group=group))), group)
    if failures:
        raise AsyncSaveError(
            f"The asynchronous save of {location} failed: {'; '.join(failures)}. It was not committed: the previous"
            " complete checkpoint under that name is unchanged. Fix the cause (disk space, permissions, storage),"
            " or pass VitScaleStrategy(async_save=False) to see the error inside the save."
        )


def _outcome(run: Callable[[], Any]) -> str | None:
    try:
        run()
    except dcp.CheckpointException as error:  # a BaseException: the writes that failed, by rank, on every rank
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(error.failures.items()))
    except Exception as error:  # noqa: BLE001 - reported to every rank, raised there
        return f"rank {dist.get_rank() if dist.is_initialized() else 0}: {type(error).__name__}: {error}"
    return None


def _exchange(error: str | None, group: Any) -> list[str]:
    """Every rank's failures, on every rank (each said once: DCP reports one rank's failure on all of them)."""
    return list(dict.fromkeys(e for e in _gather(error, group) if e is not None))


def _gather(value: Any, group: Any) -> list[Any]:
    if group is None:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered
