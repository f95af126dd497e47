"""Out-of-memory classification and the largest-batch binary search used by the GPU benchmark."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

OK = "ok"
OOM = "oom"


def classify_failure(exc: BaseException) -> str:
    """``"oom"`` when a ``torch.OutOfMemoryError`` is the exception or anywhere in its cause/context chain
    (Lightning, dynamo and Inductor re-raise it wrapped); otherwise the exception's type name, so the row is
    recorded as failed with its cause rather than ending the sweep. Decided by type, never by message text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return OOM
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return type(exc).__name__


@dataclass
class SearchResult:
    """Largest batch that trained (``None``: not even ``start``), what stopped the search, every trial's status."""

    largest: int | None
    stopped_by: str
    trials: list[tuple[int, str]] = field(default_factory=list)


def largest_batch(try_batch: Callable[[int], str], start: int, limit: int, granularity: int = 1) -> SearchResult:
    """Double from ``start`` until a batch fails or reaches ``limit``, then bisect between the last success (0 if
    ``start`` itself ran out of memory) and the first failure until they are ``granularity`` apart.

    ``try_batch(b)`` returns ``"ok"``, ``"oom"``, or another status (an exception type name, a crash): any
    non-``ok`` status counts as "does not fit", but only ``"oom"`` lets the bisection go on; another failure
    stops the search at once with the largest success so far, its status recorded in ``stopped_by``.
    """
    if start < 1 or limit < start or granularity < 1:
        raise ValueError(f"need 1 <= start <= limit and granularity >= 1; got {start}, {limit}, {granularity}")
    result = SearchResult(None, "limit")

    def attempt(batch: int) -> str:
        status = try_batch(batch)
        result.trials.append((batch, status))
        return status

    good, bad, batch = 0, 0, start
    while True:
        status = attempt(batch)
        if status != OK:
            bad, result.stopped_by = batch, status
            break
        good = batch
        if batch == limit:
            return SearchResult(good, "limit", result.trials)
        batch = min(2 * batch, limit)
    while result.stopped_by == OOM and bad - good > granularity:
        mid = (good + bad) // 2
        status = attempt(mid)
        if status == OK:
            good = mid
        elif status == OOM:
            bad = mid
        else:
            result.stopped_by = status
    result.largest = good or None
    return result


@dataclass(frozen=True)
class Fit:
    """A largest-batch estimate from peaks measured at two batches.

    Attributes:
        batch: the batch to try: the estimate, rounded down to ``granularity`` and at most the limit.
        unbounded: the estimate before the limit (``None`` if the peak does not grow with the batch).
        base_gib: the line's intercept (parameters, gradients, optimizer state, workspaces).
        per_sample_gib: its slope (activations per sample).
        bound: ``"memory"`` (the estimate) or ``"limit"`` (the cap was lower).
    """

    batch: int
    unbounded: int | None
    base_gib: float
    per_sample_gib: float
    bound: str


def fit_largest(points: list[tuple[int, float]], memory_gib: float, fraction: float, granularity: int,
                limit: int) -> Fit:
    """The batch whose peak reaches ``fraction`` of ``memory_gib`` on the line through two ``(batch, peak GiB)``
    points; the fraction leaves the allocator's fragmentation and the CUDA context their room."""
    (b1, p1), (b2, p2) = sorted(points)
    if b2 == b1:
        raise ValueError(f"need peaks at two different batches; got {points}")
    slope = (p2 - p1) / (b2 - b1)
    base = p1 - slope * b1
    if slope <= 0:
        return Fit(limit, None, base, slope, "limit")
    unbounded = int((fraction * memory_gib - base) / slope)
    batch = min(unbounded, limit) // granularity * granularity
    return Fit(max(batch, granularity), unbounded, base, slope, "memory" if unbounded < limit else "limit")


def step_down(batch: int, granularity: int, factor: float = 0.8) -> int:
    """The next smaller batch to try after an out-of-memory: ``factor`` of it, rounded down to ``granularity``,
    and always smaller (0: nothing left to try)."""
    smaller = int(batch * factor) // granularity * granularity
    return min(smaller, batch - granularity) if batch > granularity else 0
