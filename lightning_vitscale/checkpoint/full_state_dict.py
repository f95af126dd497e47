"""``model.state_dict()`` / ``load_state_dict()`` of a sharded model as under DDP: plain full tensors.

Hooks (:func:`install`) gather each sharded tensor, one at a time, to the **CPU** (a model that only fits sharded
has no device room for a full copy); a loaded full tensor is cut into this rank's shard (no communication).
``keep_vars=True`` returns the live shards. A gather is a collective: a side-group handshake first
(``distributed/collective_guard.py``), so a call on one rank fails with :class:`StateDictGatherError`, nothing sent
on the model's group. The strategy's own DCP code runs inside :func:`sharded_state_dicts`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_vitscale._compat import dtensor_local, tree_map
from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint import state_dict_writes
from lightning_vitscale.checkpoint.errors import StateDictGatherError
from lightning_vitscale.distributed import collective_guard
from lightning_vitscale.row_layout import PACKED_ROWS, interleaved_rows, packed_rows, reorder_packed

_MARK = "_vitscale_full_state_dict"


class _Local(threading.local):
    internal = 0  # depth of sharded_state_dicts() blocks on this thread
    outermost: nn.Module | None = None  # the module whose state_dict() the user called


_local = _Local()
# module -> the outer FSDP unit around it (weakly: the hooks must not keep a model alive).
_OUTER: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()


@contextmanager
def sharded_state_dicts() -> Iterator[None]:
    """Inside the block, hooked modules' state dicts are FSDP2's ``DTensor`` shards (the strategy's DCP code)."""
    state_dict_writes.write_back()  # a save or load reads or replaces what an earlier call's values were changed into
    _local.internal += 1
    try:
        yield
    finally:
        _local.internal -= 1


def install(model: nn.Module, outer_unit: nn.Module | None = None) -> None:
    """Hook ``model``'s submodules so their state dicts are DDP's outside :func:`sharded_state_dicts`; idempotent.
    ``outer_unit``: a load first frees what a forward left gathered there. Module-level hooks: a deep copy of the
    model (weight averaging) keeps working hooks and no reference to the strategy."""
    for module in model.modules():
        if next(module.parameters(), None) is None:
            # Nothing sharded below (metrics, activations, parameter-free containers). Hooking it anyway would
            # break modules whose hash follows their state (torchmetrics): torch's load-hook wrapper keeps a plain
            # weakref to the module, which caches the first hash, so WeakKeyDictionary lookups (ModuleTracker,
            # FlopCounterMode) miss the module after its next update.
            continue
        if outer_unit is not None:
            _OUTER[module] = weakref.ref(outer_unit)
        if module.__dict__.get(_MARK):
            continue
        module.register_state_dict_pre_hook(_before_state_dict)
        module.register_state_dict_post_hook(_gather_state_dict)
        module.register_load_state_dict_pre_hook(_shard_loaded_values)
        module.__dict__[_MARK] = True


def _before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if _local.internal:
        return
    # Nested calls (torch's recursion into children) always have a prefix: "" is a new call from outside, and
    # forgets what a call that raised midway left behind.
    if prefix == "" or _local.outermost is None:
        _local.outermost = None if keep_vars else module
        state_dict_writes.write_back()  # what the last call's values were changed into, before reading again


def _gather_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    if _local.internal or _local.outermost is not module:
        return
    _local.outermost = None
    _agree_on_gather([(key, value) for key, value in state_dict.items() if key.startswith(prefix)])
    sources = {key: value for key, value in state_dict.items() if key.startswith(prefix) and torch.is_tensor(value)}
    for key, value in sources.items():
        if isinstance(value, DTensor):
            try:
                state_dict[key] = full_tensor_on_cpu(value)
            except RuntimeError as error:
                raise _gather_error(key, error) from error
        else:
            state_dict[key] = value.cpu()  # buffers FSDP leaves whole (BatchNorm statistics): all on the CPU
    # Packed projections split by tensor parallelism: the model's own row order, as DDP's state dict holds it.
    packed = packed_rows(module)
    reorder_packed(state_dict, packed, to_model=True, prefix=prefix)
    for key, source in sources.items():  # a copy changed in place reaches the model (state_dict_writes.py)
        if state_dict[key] is not source:
            state_dict_writes.remember(state_dict[key], source, packed.get(strip_wrapper_prefixes(key[len(prefix):])))


def _agree_on_gather(items: list[tuple[str, Any]]) -> None:
    """One handshake per ``state_dict()`` call, before its first gather: the same sharded tensors on every rank."""
    sharded = [(key, tuple(value.shape)) for key, value in items if isinstance(value, DTensor)]
    if not sharded:
        return  # nothing to gather: no collective
    check = collective_guard.fingerprint(f"{key}:{shape}" for key, shape in sharded)
    try:
        collective_guard.agree(collective_guard.STATE_DICT, len(sharded), check)
    except RuntimeError as error:
        raise _gather_error(sharded[0][0], error) from error


@torch.no_grad()
def full_tensor_on_cpu(value: DTensor) -> torch.Tensor:
    """The whole tensor behind ``value`` in host memory: a collective every rank of its mesh joins."""
    return full_tensor_on(value, torch.device("cpu"))


@torch.no_grad()
def full_tensor_on(value: DTensor, device: torch.device) -> torch.Tensor:
    """The whole tensor behind ``value`` on ``device``: a collective every rank of its mesh joins."""
    mesh_device = value.device_mesh.device_type
    if value.device.type != mesh_device:  # offload="cpu": host shards, gathered by the device's backend (NCCL)
        value = cast(DTensor, value.to(mesh_device))
    whole = value.full_tensor().to(device)
    # One rank: the local tensor itself (the live parameter, or a view of the flat masters of precision/flat_step.py,
    # whose shared storage safetensors refuses): a tensor of its own instead, as every rank gets on N ranks.
    if whole.untyped_storage().data_ptr() == dtensor_local(value).untyped_storage().data_ptr():
        whole = whole.clone()
    return whole


def gather_sharded_entries(
    checkpoint: dict[str, Any], keep: bool, packed: dict[str, tuple[int, int]] | None = None
) -> None:
    """Every ``DTensor`` in ``checkpoint`` replaced in place by its whole CPU tensor (rank 0's ``torch.save`` of a
    DTensor keeps its own shard only); a collective. ``keep=False``: gathered and dropped (ranks that do not write)."""
    def gather(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        full = full_tensor_on_cpu(value)  # a collective: every rank gathers, `keep` keeps
        return full if keep else None

    for key, value in checkpoint.items():
        sharded = isinstance(value, dict) and any(isinstance(v, DTensor) for v in value.values())
        checkpoint[key] = tree_map(gather, value)
        if sharded and keep and packed:  # keyed like the model (the EMA): packed rows in the model's own order
            reorder_packed(checkpoint[key], packed, to_model=True)


def _gather_error(key: str, error: RuntimeError) -> StateDictGatherError:
    return StateDictGatherError(collective_guard.not_joined(
        f"state_dict() of a model sharded by VitScaleStrategy gathers every sharded tensor (here `{key}`)", error,
        "Call `state = model.state_dict()` on every rank and save on rank 0 only (`if trainer.is_global_zero:"
        " torch.save(state, path)`), or save with `trainer.save_checkpoint(path)` (one file in DDP's format"
        " with VitScaleStrategy(state_dict_type='full')), or turn a sharded checkpoint into one file with"
        " `python -m lightning_vitscale consolidate SRC DST`.",
    ))


def _shard_loaded_values(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """A full plain tensor for a sharded slot becomes this rank's shard of it; other shapes stay for torch's own
    size-mismatch error (torch loads from its own copy of the dict: the caller's is unchanged)."""
    if _local.internal:
        return
    slots = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    if any(isinstance(t, nn.Parameter) and not isinstance(t, DTensor) for _, t in slots):
        _reshard_all(module)  # gathered: FSDP's own load hook reshards too, but may run after this one
        slots = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    for name, target in slots:
        value = state_dict.get(prefix + name)
        if (
            isinstance(target, DTensor)
            and torch.is_tensor(value)
            and not isinstance(value, DTensor)
            and value.shape == target.shape
        ):
            spec = module.__dict__.get(PACKED_ROWS)  # a packed projection: the full value is in the model's order
            value = value.detach() if spec is None else interleaved_rows(value.detach(), *spec)
            # src_data_rank=None: every rank holds the full tensor, each keeps its own slice, no collective.
            state_dict[prefix + name] = distribute_tensor(
                value, target.device_mesh, target.placements, src_data_rank=None
            )


def _reshard_all(module: nn.Module) -> None:
    """Free every gathered unit of the model ``module`` belongs to (local): the shards are the parameters again."""
    ref = _OUTER.get(module)
    outer = ref() if ref is not None else None
    if outer is None:
        return
    release = getattr(outer, "release", None)
    if callable(release):
        release()  # OuterUnit: also forgets the gathered copy and the gradients computed on it
    for unit in outer.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
