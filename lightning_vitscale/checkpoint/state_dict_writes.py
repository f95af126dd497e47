"""In-place updates of ``model.state_dict()``'s values reach the model, as under DDP.

Under DDP a state dict's values share storage with the parameters and buffers, and libraries update a model through
them: timm's ``ModelEmaV3`` / ``ModelEmaV2`` move an EMA copy by ``torch._foreach_lerp_`` on
``ema.state_dict().values()``. Here a sharded tensor's value is a gathered copy (``full_state_dict.py``), so such an
update changed the copy only: an EMA made in ``__init__`` (sharded with the model) stayed at its first weights,
silently.

While a run is set up (the strategy's setup to its teardown), each gathered copy is remembered with its version
counter, and held: the update's copies are temporaries, gone before anything could look at them. Before anything
reads the model again (the next forward of any module, the next ``state_dict()``, a checkpoint's save or load, the
run's teardown), a copy changed in place writes this rank's part of itself into its shard (no communication: the
gather had every rank make the same call, so every rank holds the same updated copy). A forward or the teardown
forgets the unchanged ones too, so at most one call's copies (host memory of the module's size) outlive their
caller, until then; the forward hook is registered only while copies are remembered. Left: a read of the shards
themselves (``p.full_tensor()``) between the update and that point, a copy kept past a forward and changed later,
and a ``state_dict()`` after the run (DDP's would still change the model).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from lightning_vitscale._compat import tensor_version
from lightning_vitscale.row_layout import interleaved_rows


@dataclass
class _Copy:
    copy: torch.Tensor
    version: int
    source: torch.Tensor  # the state dict's own value: a detached DTensor sharing the shard, or a buffer
    packed: tuple[int, int] | None  # tensor parallelism's packed rows: the copy is in the model's order


class _Remembered:
    def __init__(self) -> None:
        self.copies: list[_Copy] = []
        self.hook: RemovableHandle | None = None
        self.lock = threading.Lock()
        self.warned = False
        self.runs = 0  # strategies set up and not torn down in this process


_REMEMBERED = _Remembered()


def start() -> None:
    """A run is set up: from now on copies are remembered."""
    with _REMEMBERED.lock:
        _REMEMBERED.runs += 1


def stop() -> None:
    """A run is torn down: what its copies were changed into is written, and nothing more is remembered."""
    write_back(forget_unchanged=True)
    with _REMEMBERED.lock:
        _REMEMBERED.runs = max(0, _REMEMBERED.runs - 1)


def remember(copy: torch.Tensor, source: torch.Tensor, packed: tuple[int, int] | None = None) -> None:
    """``copy`` (a value ``state_dict()`` returns) stands for ``source``: written back if changed in place."""
    with _REMEMBERED.lock:
        if not _REMEMBERED.runs:
            return
        _REMEMBERED.copies.append(_Copy(copy, tensor_version(copy), source, packed))
        if _REMEMBERED.hook is None:
            _REMEMBERED.hook = register_module_forward_pre_hook(_before_any_forward)


def _before_any_forward(module: torch.nn.Module, args: object) -> None:
    write_back(forget_unchanged=True)


@torch.no_grad()
def write_back(forget_unchanged: bool = False) -> int:
    """Write every remembered copy changed in place into what it stands for, and forget it. ``forget_unchanged``
    (a forward: the values are in use again): forget the others too; else they stay remembered (timm's update calls
    ``state_dict()`` twice, then changes the first call's values). Returns how many were written."""
    with _REMEMBERED.lock:
        copies, _REMEMBERED.copies = _REMEMBERED.copies, []
        if _REMEMBERED.hook is not None:
            _REMEMBERED.hook.remove()
            _REMEMBERED.hook = None
    written, kept = 0, []
    for entry in copies:
        if tensor_version(entry.copy) == entry.version:
            kept.append(entry)
            continue
        _write(entry.copy, entry.source, entry.packed)
        written += 1
    if kept and not forget_unchanged:
        with _REMEMBERED.lock:
            _REMEMBERED.copies[:0] = kept
            if _REMEMBERED.hook is None:
                _REMEMBERED.hook = register_module_forward_pre_hook(_before_any_forward)
    if written and not _REMEMBERED.warned:
        _REMEMBERED.warned = True
        rank_zero_warn(
            "Values of `state_dict()` were changed in place (an EMA updated through them, as timm's ModelEmaV3 does):"
            " VitScaleStrategy wrote them into the sharded parameters, as DDP's shared storage would. Each such"
            " `state_dict()` call gathers the whole module to the CPU; `lightning_vitscale.ShardedEMA` or Lightning's"
            " `EMAWeightAveraging` callback update the shards where they are, with no gather."
        )
    return written


def _write(copy: torch.Tensor, source: torch.Tensor, packed: tuple[int, int] | None) -> None:
    if not isinstance(source, DTensor):
        source.copy_(copy)
        return
    value = copy if packed is None else interleaved_rows(copy, *packed)
    # src_data_rank=None: every rank holds the whole copy and keeps its own part of it, as a load does.
    part = distribute_tensor(value.to(source.device), source.device_mesh, source.placements, src_data_rank=None)
    source.to_local().copy_(part.to_local())
