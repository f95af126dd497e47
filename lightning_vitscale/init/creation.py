"""Where ``configure_model()`` builds the model on each rank, so no rank builds all of it needlessly: on the exact
path rank 0 for real on the host and the others on meta (``initial_weights.py`` scatters rank 0's values), on the
meta path every rank on meta, recording the init its code runs (``replay.py``)."""

from __future__ import annotations

import hashlib
import mmap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_vitscale._utils import available_host_bytes
from lightning_vitscale.init.replay import Recipe, recording
from lightning_vitscale.init.settings import InitSettings


@dataclass
class Creation:
    """How ``configure_model()`` built the model on this rank (``recipes``, meta path: tensor name -> its recorded
    init, ``None`` if nothing set it); read by the sharding pipeline."""

    path: str  # "exact" or "meta"
    recipes: dict[str, Recipe | None]
    peak: PeakRss


class PeakRss:
    """Peak growth of this process's resident memory, sampled in a thread (resetting the kernel's VmHWM instead
    would take the process-wide peak counter from the user)."""

    INTERVAL_S = 0.002

    def __init__(self) -> None:
        self.start_time = time.perf_counter()
        self.base = self.peak = _rss_bytes() or 0
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vitscale-peak-rss")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self.peak = max(self.peak, _rss_bytes() or 0)

    def stop(self) -> tuple[int, float]:
        """Stop sampling; returns (peak growth in bytes, seconds since the start)."""
        if self.seconds is None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes() or 0)
            self.seconds = time.perf_counter() - self.start_time
        return self.peak - self.base, self.seconds


def _rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return None


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *module.named_parameters(remove_duplicate=False),
        *((n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None),
    ]


def host_copies(device: torch.device, ranks_per_node: int, world_size: int) -> float:
    """How many full-model copies rank 0's host holds on the exact path: its full copy, plus, on CPU ranks (which
    keep their shards in host memory), the shards of the host's ranks (a ``1 / world_size`` copy each)."""
    return 1.0 + (ranks_per_node / world_size if device.type == "cpu" else 0.0)


class ModelCreation:
    """The ``model_sharded_context()`` of the strategy: builds, records and reports one ``configure_model()``."""

    def __init__(self, module: nn.Module, init: InitSettings, rank: int, world_size: int, host_copies: float) -> None:
        self.module, self.init, self.rank, self.world_size = module, init, rank, world_size
        self.host_copies = host_copies
        self.result: Creation | None = None

    @contextmanager
    def context(self) -> Iterator[None]:
        peak = PeakRss()
        before = {id(t) for _, t in _tensors(self.module)}
        digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
        path = self._decide_before_building()
        # Recording on every rank (also where the build is real): a `configure_model()` that builds on meta by
        # itself then leaves every rank the same recipes.
        device_cm = nullcontext() if self.rank == 0 and path == "exact" else torch.device("meta")
        try:
            with recording() as recorder, device_cm:
                yield
        except BaseException:
            peak.stop()
            raise
        created = [(n, t) for n, t in _tensors(self.module) if id(t) not in before]
        nbytes = sum(t.numel() * t.element_size() for _, t in created)
        path = self._agree(path, created, nbytes, digest)
        if not created:
            peak.stop()
            return
        recipes = {name: recorder.recipe_of(t) for name, t in created if t.is_meta} if path == "meta" else {}
        self.result = Creation(path, recipes, peak)

    def _decide_before_building(self) -> str:
        """Rank 0 must know the path before it builds; the size comes from rank 1's meta build ("auto")."""
        if self.world_size == 1:
            return "meta" if self.init.mode == "meta" else "exact"
        if self.init.mode != "auto":
            return self.init.resolve()
        if self.rank != 0:
            return "exact"  # the others build on meta either way; rank 0 tells them the outcome afterwards
        size = [0]
        dist.broadcast_object_list(size, src=1)
        return self.init.resolve(int(size[0]), available_host_bytes(), self.host_copies)

    def _agree(self, path: str, created: list[tuple[str, torch.Tensor]], nbytes: int, digest: str) -> str:
        """After building: rank 1 reports its size ("auto"), rank 0 the path and its RNG state: on the exact path
        ranks that were in rank 0's state before (``seed_everything``) skipped its draws, and continue from its
        state after, as under DDP."""
        if self.rank == 0:
            path = self._checked(path, created)
        if self.world_size > 1:
            if self.init.mode == "auto" and self.rank != 0:
                dist.broadcast_object_list([nbytes], src=1)
            message: list[Any] = [path, digest, torch.get_rng_state()]
            dist.broadcast_object_list(message, src=0)
            path, digest0, state0 = message
            if path == "exact" and self.rank != 0 and digest == digest0:
                torch.set_rng_state(state0)
        if path.startswith("error:"):
            raise ValueError(path.removeprefix("error:"))
        return path

    def _checked(self, path: str, created: list[tuple[str, torch.Tensor]]) -> str:
        """A ``configure_model()`` that builds on meta itself leaves nothing to copy: the meta path, or an error
        (``"error:..."``, raised on every rank)."""
        if path != "exact" or not any(t.is_meta for _, t in created):
            return path
        if self.init.mode != "exact":
            return "meta"
        return (
            "error:VitScaleStrategy(init='exact') needs `configure_model()` to build real tensors on rank 0, but it"
            " built them on the meta device. Remove the `with torch.device('meta')` (the strategy builds the other"
            " ranks on meta itself) or pass init='meta' to initialise the shards with the model's own init code."
        )

