"""What to recompute: the setting behind ``activation_checkpointing=`` and ``memory_budget=``, checked when made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from lightning_vitscale._utils import documented
from lightning_vitscale.memory import check_budget

BlockCheckpointing = bool | Literal["full", "selective"]
"""One block's checkpointing, as an ``activation_checkpointing`` callable returns it."""
CheckpointSelector = bool | int | Literal["auto", "full", "selective"] | Callable[[str, nn.Module], BlockCheckpointing]
"""What ``activation_checkpointing=`` takes: :attr:`CheckpointingPolicy.blocks`' text says each choice."""
_MODE_WORDS: tuple[str, ...] = ("full", "selective")


@dataclass(frozen=True)
class CheckpointingPolicy:
    """Which blocks recompute their activations in backward; each field's text is in its ``metadata["doc"]``."""

    blocks: CheckpointSelector | None = documented(None, (
        "``True``/``\"full\"``: every block stores only its input and reruns its forward in backward (least"
        " memory); ``\"selective\"``: every block keeps its matmul, convolution and attention outputs and recomputes"
        " only the cheap ops; ``False``: none; ``k``: every k-th block, fully; a predicate ``(name, module) ->"
        " True/False/\"full\"/\"selective\"`` per block; ``\"auto\"``: the plan (per block none/selective/full,"
        " units kept gathered or resharded, blocks per unit) with the least predicted step time whose per-rank"
        " peak fits ``memory_budget``, decided at setup from ``example_input_array`` or one train batch (run"
        " through ``training_step``), else at the first training step (docs/memory.md). ``None``: as ``priority``"
        " says: ``\"speed\"``, ``\"auto\"`` (the recipe's plan, with a warning, where the step cannot run on fake"
        " tensors); ``\"memory\"``, ``True``."
    ))
    memory_budget: int | float | None = documented(None, (
        "Bytes a training step may use per rank (an ``int``), or a fraction of the device's memory (a ``float`` in"
        " (0, 1]; on CPU of the host's available memory divided among the local ranks, the smallest any rank"
        " has); ``None`` is 0.9. Every choice the planner makes keeps to it: the checkpointing, the blocks per"
        " unit and units kept gathered (``priority=\"speed\"``, ``activation_checkpointing=\"auto\"``) and"
        " ``accumulation=\"auto\"``; the setup summary names it and says when the predicted peak is over it."
    ))

    def __post_init__(self) -> None:
        sel = self.blocks
        check_budget(self.memory_budget)
        if sel is None or sel in ("auto", *_MODE_WORDS) or isinstance(sel, bool) or callable(sel):
            return
        if isinstance(sel, int):
            if sel < 1:
                raise ValueError(
                    f"`activation_checkpointing={sel}` is not valid: an int k checkpoints every k-th block and must"
                    " be >= 1 (use False to turn checkpointing off)."
                )
            return
        raise TypeError(
            f"`activation_checkpointing` must be True, False, 'full', 'selective', an int k >= 1, a callable"
            f" (name, module) -> True/False/'full'/'selective', or 'auto'; got {sel!r}."
        )

    @property
    def is_auto(self) -> bool:
        return self.blocks == "auto"

    def mode(self, index: int, name: str, module: nn.Module) -> Literal["full", "selective"] | None:
        """How the ``index``-th block (model order) is checkpointed; ``"auto"``'s choice is applied by setup."""
        sel = self.blocks
        if sel is None or sel == "auto":
            return None
        if isinstance(sel, int) and not isinstance(sel, bool):
            return "full" if (index + 1) % sel == 0 else None
        answer = sel(name, module) if callable(sel) else sel  # a callable's answer: a mode word, or read as a bool
        if isinstance(answer, str) and answer not in _MODE_WORDS:
            raise ValueError(
                f"The `activation_checkpointing` callable returned {answer!r} for block {name!r}; a string must be"
                " 'full' or 'selective' (or return True/False)."
            )
        return "selective" if answer == "selective" else "full" if answer else None
