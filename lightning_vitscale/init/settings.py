"""How a model built in ``configure_model()`` gets its starting weights (``init=``); the one place "auto" is decided."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

InitMode = Literal["auto", "exact", "meta"]
INIT_MODES: tuple[str, ...] = get_args(InitMode)
InitPath = Literal["exact", "meta"]


@dataclass(frozen=True)
class InitSettings:
    """``VitScaleStrategy(init=...)``, checked when the strategy is made.

    ``"exact"``: rank 0 builds the model for real and every unit's shards are scattered from it as it is sharded,
    so the weights equal DDP's bit for bit; it needs one full copy in rank 0's host memory. ``"meta"``: every rank
    builds on the meta device and runs the model's own init on its shards (same distributions, other values).
    ``"auto"``: see :meth:`resolve`.
    """

    mode: InitMode = "auto"

    def __post_init__(self) -> None:
        if self.mode not in INIT_MODES:
            raise ValueError(
                f"`init={self.mode!r}` is not supported. Choose one of: {', '.join(INIT_MODES)}"
                " (e.g. VitScaleStrategy(init=\"exact\") for DDP's initial weights bit for bit)."
            )

    def resolve(self, full_bytes: int = 0, available_bytes: int | None = None, host_copies: float = 1.0) -> InitPath:
        """The path to take: ``"auto"`` is exact when ``host_copies`` x the model (rank 0's full copy plus the
        shards the host's other ranks keep in host memory) fits in 80% of the host's available memory, else
        meta; unknown memory means exact."""
        match self.mode:
            case "exact":
                return "exact"
            case "meta":
                return "meta"
            case _:
                fits = available_bytes is None or full_bytes * host_copies <= 0.8 * available_bytes
                return "exact" if fits else "meta"
