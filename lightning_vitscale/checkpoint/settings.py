"""How checkpoints are written (``state_dict_type=``), checked when the strategy is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

StateDictType = Literal["sharded", "full"]


@dataclass(frozen=True)
class CheckpointSettings:
    """``"sharded"``: every rank writes its own shards (a folder); ``"full"``: rank 0 writes one DDP-style file.
    ``auto_resume``: ``fit()`` resumes from the newest complete checkpoint in the ModelCheckpoint folder
    (checkpoint/resume.py)."""

    state_dict_type: StateDictType = "sharded"
    auto_resume: bool = False

    def __post_init__(self) -> None:
        if self.state_dict_type not in get_args(StateDictType):
            raise ValueError(
                f"`state_dict_type={self.state_dict_type!r}` is not supported. Choose 'sharded' (a folder of"
                " per-rank shards, the default) or 'full' (one file in DDP's format that"
                " `MyModule.load_from_checkpoint` reads)."
            )
        if not isinstance(self.auto_resume, bool):
            raise TypeError(f"`auto_resume` must be True or False; got {self.auto_resume!r}.")

    @property
    def full(self) -> bool:
        return self.state_dict_type == "full"
