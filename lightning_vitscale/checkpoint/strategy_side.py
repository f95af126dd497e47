"""The strategy's checkpoint side: each checkpoint hook of ``VitScaleStrategy`` calls one method of this object,
which owns the settings, the async saves, the resume fallbacks and the broadcast of every path from rank 0 (the
ranks may have formatted it differently).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Generic, Literal, TypeVar, cast

import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_vitscale._utils import trainer_of
from lightning_vitscale.checkpoint import state_dict_writes
from lightning_vitscale.checkpoint.async_save import AsyncSaves
from lightning_vitscale.checkpoint.consolidate import consolidate_command
from lightning_vitscale.checkpoint.exception_save import ExceptionSave
from lightning_vitscale.checkpoint.load import HandedModelState, apply_model_state, load_checkpoint
from lightning_vitscale.checkpoint.resume import verified_checkpoint
from lightning_vitscale.checkpoint.save import (
    model_state_dict,
    optimizer_state_dict,
    remove_checkpoint,
    save_checkpoint,
)
from lightning_vitscale.checkpoint.settings import CheckpointSettings, StateDictType
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.distributed.ranks import RankContext
from lightning_vitscale.row_layout import packed_rows


class StrategyCheckpoints:
    """Saves, loads and removes checkpoints for a strategy; ``settings`` is what the user asked for."""

    def __init__(self, settings: CheckpointSettings, timeout: timedelta) -> None:
        self.settings = settings
        self.saves = AsyncSaves(timeout)
        self.resume_fallbacks: list[Location] = []  # ``resume.py``'s older ones: the next load tries them in turn
        self._told_how_to_consolidate = False
        self.exception_save = ExceptionSave()  # an exception's save on this rank alone: skipped (exception_save.py)
        self._handed: HandedModelState | None = None  # the last load's model state, applied after the hook

    def model_state(self, module: nn.Module | None) -> dict[str, Any]:
        assert module is not None
        if self.exception_save.alone(trainer_of(module)):
            return {}
        return model_state_dict(module, full=self.settings.full)

    def optimizer_state(
        self, module: nn.Module | None, optimizer: torch.optim.Optimizer, ranks: RankContext
    ) -> dict[str, Any]:
        assert module is not None
        if self.exception_save.alone(trainer_of(module)):
            return {}
        return optimizer_state_dict(module, optimizer, self.settings.full, ranks.is_rank_zero)

    def save(
        self, checkpoint: dict[str, Any], filepath: Any, *, ranks: RankContext, write_full: Any,
        storage_options: Any | None, trainer: Any,
    ) -> None:
        if self.exception_save.alone(trainer):
            self.exception_save.skipped(filepath)
            return
        location = Location.of(ranks.broadcast(str(filepath)))
        # In the background only while fit runs (it waits for the last save); other saves finish before returning.
        fitting = trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
        saves = self.saves if self.settings.async_save and fitting else None
        packed = packed_rows(trainer.lightning_module)
        save_checkpoint(checkpoint, location, self.settings, write_full, ranks, storage_options, saves, packed)
        if not self.settings.full and not self._told_how_to_consolidate:  # once: how other tools read the folder
            self._told_how_to_consolidate = True
            rank_zero_info(
                f"Sharded checkpoint folder written: {location}. Outside VitScaleStrategy:"
                " `MyModule.load_from_checkpoint(lightning_vitscale.consolidated(path))`; a resume under"
                " strategy='ddp': `Trainer(plugins=[lightning_vitscale.VitScaleCheckpointIO()])`. One torch.save"
                f" file for other tools: `{consolidate_command(location.url)}`, or"
                " VitScaleStrategy(state_dict_type='full')."
            )

    def load(
        self, checkpoint_path: Any, module: Any, optimizers: list[torch.optim.Optimizer], weights_only: bool | None,
        *, ranks: RankContext,
    ) -> dict[str, Any]:
        """The newest complete checkpoint saved to the path, CRC-32s checked (``resume.py``), validated on every
        rank before the first collective (a wrong path fails alike everywhere, no rank left waiting)."""
        self.saves.wait()
        location = Location.of(ranks.broadcast(str(checkpoint_path)))
        fallbacks, self.resume_fallbacks = self.resume_fallbacks, []
        location = verified_checkpoint(location, fallbacks, ranks)
        checkpoint, self._handed = load_checkpoint(location, module, optimizers, module.strict_loading, weights_only)
        return checkpoint

    def load_model_state(self, checkpoint: Mapping[str, Any], module: nn.Module | None, strict: bool) -> None:
        """After ``on_load_checkpoint``: its ``checkpoint["state_dict"]`` into the model, as under DDP (``load.py``)."""
        handed, self._handed = self._handed, None
        if handed is not None and module is not None:
            apply_model_state(checkpoint, handed, module, strict)

    def remove(self, filepath: Any, *, ranks: RankContext) -> None:
        self.saves.wait()  # a folder still being written must not be deleted under the writer
        location = Location.of(ranks.broadcast(str(filepath)))
        remove_checkpoint(location, ranks)

    def before_train_batch(self) -> None:
        self.saves.raise_if_failed()  # a background save that failed since the last step

    def after_fit(self) -> None:
        self.saves.wait()  # after ModelCheckpoint's last save: fit returns with every save committed

    def close(self) -> None:
        self.saves.close()  # also after an exception, which close() does not mask
        state_dict_writes.stop()  # the run's state_dict() values changed in place, written (started at setup)


T = TypeVar("T")


class OnCheckpointSide(Generic[T]):
    """A public strategy attribute (``checkpoint_settings``, ``state_dict_type``) kept on its checkpoint side."""

    def __init__(self, field: Literal["settings", "state_dict_type"]) -> None:
        self.field = field

    def __get__(self, strategy: Any, owner: type | None = None) -> T:
        if strategy is None:
            return self  # type: ignore[return-value]  # on the class: the descriptor itself, as a property
        side: StrategyCheckpoints = strategy.checkpoints
        return cast(T, side.settings if self.field == "settings" else side.settings.state_dict_type)

    def __set__(self, strategy: Any, value: T) -> None:
        side: StrategyCheckpoints = strategy.checkpoints
        if self.field == "settings":
            side.settings = cast(CheckpointSettings, value)
        else:  # validated again, with the other settings: CheckpointSettings.__post_init__
            side.settings = dataclasses.replace(side.settings, state_dict_type=cast(StateDictType, value))


def model_state_after_hook(strategy: Any, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
    """``Strategy.load_model_state_dict``, which Lightning calls after ``on_load_checkpoint``: the hook's
    ``checkpoint["state_dict"]`` into the model, as under DDP (``StrategyCheckpoints.load_model_state``)."""
    strategy.checkpoints.load_model_state(checkpoint, strategy.lightning_module, strict)
