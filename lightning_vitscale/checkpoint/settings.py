"""How checkpoints are written (``state_dict_type=``), checked when the strategy is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from lightning_vitscale._utils import documented

StateDictType = Literal["sharded", "full"]


@dataclass(frozen=True)
class CheckpointSettings:
    """How checkpoints are written and found. Each field's text is in its ``metadata["doc"]`` (the one source of
    ``VitScaleStrategy``'s Args and README's options table, ``lightning_vitscale/options.py``)."""

    state_dict_type: StateDictType = documented("sharded", (
        "``\"sharded\"``: checkpoints are folders, each rank writes its own shards; ``\"full\"``: rank 0 writes"
        " one file in DDP's format (gathered one tensor at a time), which ``MyModule.load_from_checkpoint`` reads"
        " and a ``strategy=\"ddp\"`` run resumes from."
    ))
    auto_resume: bool = documented(False, (
        "``fit()`` resumes from the newest complete checkpoint in the ``ModelCheckpoint(dirpath=...)`` folder"
        " (skipping interrupted, incomplete and corrupt ones, checkpoint/resume.py), and starts from"
        " ``ckpt_path`` (or from scratch) only when there is none: resubmitting the same command after a"
        " failure continues the run."
    ))
    async_save: bool = documented(False, (
        "Sharded saves during ``fit`` copy this rank's shards into host memory and return; DCP writes them in"
        " the background (one save in flight at most, checkpoint/async_save.py), the checkpoint is committed"
        " once every rank wrote, a failure is raised at the next training step, and ``fit`` waits for the last"
        " save."
    ))

    def __post_init__(self) -> None:
        if self.state_dict_type not in get_args(StateDictType):
            raise ValueError(
                f"`state_dict_type={self.state_dict_type!r}` is not supported. Choose 'sharded' (a folder of"
                " per-rank shards, the default) or 'full' (one file in DDP's format that"
                " `MyModule.load_from_checkpoint` reads)."
            )
        for name, value in (("auto_resume", self.auto_resume), ("async_save", self.async_save)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False; got {value!r}.")
        if self.async_save and self.full:
            raise ValueError(
                "`async_save=True` writes sharded checkpoints in the background; state_dict_type='full' gathers the"
                " model into one file on rank 0, which cannot be staged per rank. Use state_dict_type='sharded' (and"
                " `python -m lightning_vitscale consolidate` for one file), or async_save=False."
            )

    @property
    def full(self) -> bool:
        return self.state_dict_type == "full"
