"""Every change this package makes to Lightning, in one place, and when each is made.

Lightning opens checkpoint paths and resolves ``ckpt_path`` in private code that runs before any strategy code
and offers no public hook (a custom ``CheckpointIO`` would serve the Trainer only, and only if the user passed
it). The routes the README documents need three of them wrapped, each wrapper handing everything that is not
this package's to Lightning's original, unchanged:

At ``import lightning_vitscale`` (:func:`install_import_patches`), since these routes run in processes that never
create a ``VitScaleStrategy`` (an inference script, a ``strategy="ddp"`` run resuming from a sharded folder):

* ``pl_load`` in ``lightning.pytorch.core.saving`` (``MyModule.load_from_checkpoint``) and in
  ``lightning.pytorch.plugins.io.torch_plugin`` (``fit(ckpt_path=...)`` under ``strategy="ddp"`` or a single
  device): a folder holding this package's marker file is read as the dict ``torch.load`` returns for its
  consolidated file (``loaders.py``); files, buffers, URLs and other folders go to Lightning's ``pl_load``.
* ``ModelCheckpoint._find_last_checkpoints`` (``ckpt_path="last"``): where the ModelCheckpoint folder holds
  sub-folders (sharded checkpoints, or what an interrupted save of one left) or the Trainer's strategy is a
  ``VitScaleStrategy``, each ``last*.ckpt`` becomes its newest complete checkpoint (``checkpoint/resume.py``);
  for a folder of files under Lightning's own strategies, Lightning's answer is returned untouched.

When a ``VitScaleStrategy`` is created (:func:`install_strategy_patches`):

* ``_CheckpointConnector._parse_ckpt_path``: under ``VitScaleStrategy(auto_resume=True)`` when fitting, the newest
  complete checkpoint in the ModelCheckpoint folders wins over ``ckpt_path``; any other strategy or call goes to
  Lightning's original.

Nothing else is patched: ``torch.load``, Lightning's strategies, ``CheckpointIO`` classes and ``Trainer`` stay
Lightning's and torch's (``tests/unit/checkpoint/test_import_side_effects.py`` checks that an import changes
exactly the names in :data:`PATCHED_AT_IMPORT` and that a ``strategy="ddp"``-style run saves and loads as without
it). Each install is idempotent: a second call (a module reload) does not stack wrappers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_vitscale._compat import PL_LOAD_MODULES, CheckpointConnector, checkpoint_dir
from lightning_vitscale.checkpoint.lightning.loaders import is_sharded_checkpoint, load_sharded_as_full
from lightning_vitscale.checkpoint.resume import auto_resume_path, last_with_fallbacks, path_for_lightning
from lightning_vitscale.checkpoint.storage import Location
from lightning_vitscale.checkpoint.strategy_side import strategy_checkpoints

# (owner, name) of what `import lightning_vitscale` wraps; `_parse_ckpt_path` only once a VitScaleStrategy exists.
PATCHED_AT_IMPORT: tuple[tuple[Any, str], ...] = (
    *((module, "pl_load") for module in PL_LOAD_MODULES),
    (ModelCheckpoint, "_find_last_checkpoints"),
)
PATCHED_BY_STRATEGY: tuple[tuple[Any, str], ...] = ((CheckpointConnector, "_parse_ckpt_path"),)
_wrappers: set[Callable[..., Any]] = set()  # what this module installed, so no install stacks a second wrapper


def _wrap_pl_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
        if is_sharded_checkpoint(path_or_url):
            return load_sharded_as_full(path_or_url, map_location=map_location, weights_only=weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only, **kwargs)

    return pl_load


def _holds_folders(folder: Location) -> bool:
    """Whether ``folder`` holds a sub-folder (a sharded checkpoint, or what an interrupted save of one left)."""
    return folder.is_dir() and any(folder.child(name).is_dir() for name in folder.names())


def _wrap_find_last(original: Callable[..., set[str]]) -> Callable[..., set[str]]:
    @functools.wraps(original)
    def _find_last_checkpoints(self: ModelCheckpoint, trainer: Any) -> set[str]:
        found = original(self, trainer)
        folder = Location.of(checkpoint_dir(self, trainer))
        side = strategy_checkpoints(trainer.strategy)
        if side is None and not _holds_folders(folder):
            return found  # Lightning's own strategy and files only: Lightning's answer, untouched
        theirs = {p for p in found if not Location.of(p).is_dir()}  # Lightning's own files
        ours, others = last_with_fallbacks(self, folder, side is not None) if folder.is_dir() else ([], [])
        if side is not None:
            side.resume_with_fallbacks(ours + others)  # tried in order if the chosen one is corrupt
        return theirs | {path_for_lightning(location) for location in ours}

    return _find_last_checkpoints


def _wrap_parse(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _parse_ckpt_path(self: Any, state_fn: TrainerFn, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        side = strategy_checkpoints(self.trainer.strategy)
        if state_fn == TrainerFn.FITTING and side is not None and side.settings.auto_resume:
            found, fallbacks = auto_resume_path(self.trainer)
            side.resume_with_fallbacks(fallbacks)
            if found is not None:
                ignored = f" (ckpt_path={ckpt_path!r} is ignored: there is a run to resume)" if ckpt_path else ""
                rank_zero_info(f"auto_resume: resuming from {found}{ignored}")
                return path_for_lightning(found)
            rank_zero_warn(f"auto_resume: no complete checkpoint found; starting from ckpt_path={ckpt_path!r}.")
        return original(self, state_fn, ckpt_path, *args, **kwargs)

    return _parse_ckpt_path


def _install(owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    current = getattr(owner, name)
    if current not in _wrappers:
        wrapper = wrap(current)
        _wrappers.add(wrapper)
        setattr(owner, name, wrapper)  # the patch itself: Lightning's attribute, see the module docstring


def install_import_patches() -> None:
    """What ``import lightning_vitscale`` installs (idempotent): the ``pl_load`` names and ``ckpt_path="last"``."""
    for module in PL_LOAD_MODULES:
        _install(module, "pl_load", _wrap_pl_load)
    _install(ModelCheckpoint, "_find_last_checkpoints", _wrap_find_last)


def install_strategy_patches() -> None:
    """What creating a ``VitScaleStrategy`` installs (idempotent): ``auto_resume``'s ``ckpt_path`` resolution."""
    _install(CheckpointConnector, "_parse_ckpt_path", _wrap_parse)
