"""How a model built in ``configure_model()`` gets its starting weights (``init=``); the one place "auto" is decided."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from lightning_vitscale._utils import documented

InitMode = Literal["auto", "exact", "meta"]
INIT_MODES: tuple[str, ...] = get_args(InitMode)
InitPath = Literal["exact", "meta"]


@dataclass(frozen=True)
class InitSettings:
    """``VitScaleStrategy(init=...)``, checked when the strategy is made (``mode``'s text: ``options.py``)."""

    mode: InitMode = documented("auto", (
        "How a model built in ``configure_model()`` gets its starting weights: ``\"exact\"`` (rank 0 builds it,"
        " the others build on meta and receive their shards from rank 0 unit by unit: DDP's weights bit for bit,"
        " one full copy in rank 0's host memory), ``\"meta\"`` (every rank builds on meta and runs the model's"
        " own init on its shards: same distributions, other values) or ``\"auto\"`` (exact when that copy fits"
        " in 80% of rank 0's host memory)."
    ))

    def __post_init__(self) -> None:
        if self.mode not in INIT_MODES:
            raise ValueError(
                f"`init={self.mode!r}` is not supported. Choose one of: {', '.join(INIT_MODES)}"
                " (e.g. VitScaleStrategy(init=\"exact\") for DDP's initial weights bit for bit)."
            )

    def resolve(self, full_bytes: int = 0, available_bytes: int | None = None, host_copies: float = 1.0) -> InitPath:
        """``"auto"``: exact when ``host_copies`` x the model (:func:`~.creation.host_copies`) fits in 80% of the host's
        available memory, else meta; unknown memory means exact."""
        match self.mode:
            case "exact" | "meta":
                return self.mode
            case _:
                fits = available_bytes is None or full_bytes * host_copies <= 0.8 * available_bytes
                return "exact" if fits else "meta"
