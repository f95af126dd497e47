"""How checkpoints are written (``state_dict_type=``), checked when the strategy is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

StateDictType = Literal["sharded", "full"]


@dataclass(frozen=True)
class CheckpointSettings:
    """``"sharded"``: every rank writes its own shards (a folder); ``"full"``: rank 0 writes one DDP-style file.
    ``async_save``: sharded saves during ``fit`` copy the shards into host memory and write them in the background
    (checkpoint/async_save.py). ``auto_resume``: ``fit()`` resumes from the newest complete checkpoint in the
    ModelCheckpoint folder (checkpoint/resume.py)."""

    state_dict_type: StateDictType = "sharded"
    auto_resume: bool = False
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.state_dict_type not in get_args(StateDictType):
            raise ValueError(
                f"`state_dict_type={self.state_dict_type!r}` is not supported. Choose 'sharded' (a folder of"
                " per-rank shards, the default) or 'full' (one file in DDP's format that"
                " `MyModule.load_from_checkpoint` reads)."
            )
        if not isinstance(self.auto_resume, bool):
            raise TypeError(f"`auto_resume` must be True or False; got {self.auto_resume!r}.")
        if not isinstance(self.async_save, bool):
            raise TypeError(f"`async_save` must be True or False; got {self.async_save!r}.")
        if self.async_save and self.full:
            raise ValueError(
                "`async_save=True` writes sharded checkpoints in the background; state_dict_type='full' gathers the"
                " model into one file on rank 0, which cannot be staged per rank. Use state_dict_type='sharded' (and"
                " `python -m lightning_vitscale consolidate` for one file), or async_save=False."
            )

    @property
    def full(self) -> bool:
        return self.state_dict_type == "full"
