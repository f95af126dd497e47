"""Writes to parameters by user code (``p.data = v``, ``p.copy_(v)``, ``p.data.mul_(m)``) reach the parameters, as
under DDP, where every parameter is one tensor every rank holds whole.

Two things would lose such a write silently here. (1) ``p.data = v`` on a DTensor rebinds the wrapper, not the
shard FSDP2 gathers and the optimizer steps (pytorch#157391): a momentum encoder updated as lightly's
``update_momentum`` does (``ema.data = ema.data * m + p.data * (1 - m)``) would never move. So the strategy's
parameters, and the gathered copies a step computes on, get a ``.data`` setter that writes ``v`` into them in place.
(2) The outer unit is gathered for the whole ``training_step`` (its forward runs the step), a block unit kept
gathered for backward from its forward on, and one rank's compute copies for the step: a write there to one of
their parameters lands on the gathered copy, freed at the end of the backward (a unit resharded after its forward:
at the forward's end, where a write its own forward made, EDM2's forced weight normalization, would go). So each
copy's version is recorded when gathered and, at the step's end (or before a backward inside it) and as each unit's
forward ends, a copy written since is carried to its parameter: exactly where the copy has the parameter's dtype; a
lower-precision copy (``bf16-mixed``'s O2) is refused, naming where the write keeps full precision (an fp32
parameter rounded to bf16 every step stalls an EMA). (Units gathered before the user's code ran, by a prefetch, are
the third way: ``fsdp.set_prefetch`` issues none there.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.hooks import RemovableHandle

from lightning_vitscale._compat import (
    dtensor_local,
    fsdp_param_groups,
    gathered_to_sharded,
    parameter_slots,
    plain_data,
    tensor_versions,
)
from lightning_vitscale.sharding.unit_members import outer_unit_parameters


class ParameterWriteError(RuntimeError):
    """A write to a parameter that VitScaleStrategy cannot carry to it as DDP would."""


WHERE_WRITES_KEEP_PRECISION = (
    "Make the write where the module holds its fp32 parameters: in `on_train_batch_start` (before the step) or"
    " `on_train_batch_end` (after the optimizer step), e.g. a momentum encoder's update, a weight normalization."
)


def assign_data(param: torch.Tensor, value: Any) -> None:
    """``param.data = value``, done in place: every alias of ``param`` (FSDP2's shard storage, a flat buffer's view,
    the optimizer's reference) sees ``value``. ``value``: a tensor of ``param``'s shape (a plain one is the whole
    tensor, as every rank holds it under DDP; a DTensor is laid out as ``param`` first)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"assigned data must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(param.shape):
        raise ParameterWriteError(
            f"`.data = ` with a tensor of shape {tuple(value.shape)} on a parameter of shape {tuple(param.shape)}"
            " that VitScaleStrategy shards: the assignment is done in place (FSDP2 and the optimizer keep the"
            " parameter's storage), so the shape cannot change during fit. Resize it before fit (in `__init__` or"
            " `configure_model`), or register a new `nn.Parameter` there."
        )
    with torch.no_grad():
        if isinstance(param, DTensor):
            if isinstance(value, DTensor):
                laid_out = value.redistribute(param.device_mesh, param.placements)
            else:  # each rank takes its own part of the whole: no communication
                laid_out = distribute_tensor(value.detach(), param.device_mesh, param.placements, src_data_rank=None)
            dtensor_local(param).copy_(dtensor_local(laid_out))
        else:
            param.copy_(value.full_tensor() if isinstance(value, DTensor) else value)


def _data(self: torch.Tensor) -> torch.Tensor:
    return plain_data(self)


def _set_data(self: torch.Tensor, value: Any) -> None:
    assign_data(self, value)


@contextmanager
def _as(tensor: torch.Tensor, cls: type) -> Iterator[None]:
    assignable, tensor.__class__ = tensor.__class__, cls
    try:
        yield
    finally:
        tensor.__class__ = assignable


class AssignableDTensor(DTensor):
    """A DTensor parameter whose ``.data = v`` writes ``v`` into its shard; copied and pickled as a DTensor."""

    __slots__ = ()
    data = property(_data, _set_data)  # type: ignore[assignment]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        with _as(self, DTensor):
            return copy.deepcopy(self, memo)

    def register_hook(self, hook: Callable[[torch.Tensor], Any]) -> Any:
        """Refused: a step computes this parameter's gradient for another tensor (the gathered parameter, a compute
        copy), so a hook here would run for almost none of it; hooks registered before ``fit`` are carried there
        (``user_grad_hooks.py``)."""
        raise ParameterWriteError(
            "`register_hook` on a parameter VitScaleStrategy has sharded (after setup: `on_fit_start`, a callback):"
            " its gradients are computed for the gathered parameter each step, so the hook would not see them. Register"
            " it before fit, in `__init__` or `configure_model`: hooks there run on each rank's whole gradient before"
            " it is averaged, as under DDP."
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        with _as(self, DTensor):
            return self.__reduce_ex__(protocol)


def _detached(self: torch.Tensor) -> torch.Tensor:
    return self.detach()


class AssignableParameter(nn.Parameter):
    """A gathered or computing copy of a parameter whose ``.data = v`` writes ``v`` into its storage (which FSDP2 or
    the compute copies fill and read), so the step's write is seen, and carried, like an in-place one. Its ``.data``
    is ``detach()``: torch's ``.data`` has a version counter of its own, so ``p.data.mul_(m)`` (DINO's teacher
    update) would leave no trace on the copy's."""

    data = property(_detached, _set_data)  # type: ignore[assignment]

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]  # `print(p)` as under DDP
        with _as(self, nn.Parameter):
            return repr(self)


def make_assignable(param: torch.Tensor) -> torch.Tensor:
    """``param`` with the in-place ``.data`` setter (the same object: optimizers and hooks keyed by it still hold)."""
    if type(param) is DTensor:
        param.__class__ = AssignableDTensor
    elif type(param) is nn.Parameter:
        param.__class__ = AssignableParameter
    return param


def make_parameters_assignable(module: nn.Module) -> None:
    for param in module.parameters():
        make_assignable(param)


class GatheredWrites:
    """The gathered parameters of a step's FSDP units (FSDP2's path): their versions when gathered, and the writes
    since carried to the sharded parameters. ``units``: per unit, the unit (what ``sharded_of`` maps) and the
    (module, name) of each of its parameters; the first is the outer unit, gathered as the step starts. ``sharded_of``:
    id of each gathered parameter of a unit -> its sharded one (read only when a write is found)."""

    def __init__(self, units: list[tuple[Any, list[tuple[nn.Module, str]]]],
                 sharded_of: Callable[[Any], dict[int, Any]], root: nn.Module) -> None:
        self._units = units
        self._sharded_of = sharded_of
        self._root = root
        self._seen: dict[int, tuple[list[torch.Tensor], list[int]]] = {}  # unit -> its gathered parameters, versions

    def begin_step(self) -> None:
        """The step starts, the outer unit gathered: what it starts from."""
        self._seen = {}
        self.record(0)

    def record(self, unit: int) -> None:
        """Unit ``unit`` gathered (its forward starts): its parameters' versions, once per gather (a unit of several
        blocks gathers at its first block; a write before a later one's forward is the step's)."""
        if unit in self._seen:
            return
        seen: dict[int, torch.Tensor] = {}
        for module, name in self._units[unit][1]:
            param = parameter_slots(module)[name]
            if param is not None and not isinstance(param, DTensor):  # a DTensor takes writes itself
                seen[id(param)] = make_assignable(param)
        params = list(seen.values())
        self._seen[unit] = (params, tensor_versions(params))

    def forget_if_resharded(self, unit: int) -> None:
        """After the unit's forward: resharded (nothing kept for backward), its next gather is recorded anew."""
        seen = self._seen.get(unit)
        if seen is not None and unit != 0:
            module, name = self._units[unit][1][0]
            if isinstance(parameter_slots(module)[name], DTensor):
                del self._seen[unit]

    def carry(self) -> None:
        """Each gathered parameter written since it was recorded written to its sharded parameter (no
        communication: each rank writes its own part of the whole it holds)."""
        for unit in list(self._seen):
            self.carry_unit(unit)

    def carry_unit(self, unit: int, writer: nn.Module | None = None) -> None:
        """:meth:`carry` for one unit: also as its forward ends, before FSDP2 reshards it, for a write its own forward
        made (EDM2's forced weight normalization, ``self.weight.copy_(normalize(w))`` in ``forward``), which the
        reshard would drop with the gathered copy. ``writer``: the module whose forward just ran, named if refused."""
        seen = self._seen.get(unit)
        if seen is None:
            return
        params, versions = seen
        now = tensor_versions(params)
        if now == versions:
            return
        sharded_of = self._sharded_of(self._units[unit][0])
        for gathered in (param for param, was, is_ in zip(params, versions, now) if was != is_):
            sharded = sharded_of.get(id(gathered))
            if sharded is None:
                continue  # not gathered by this unit (a slot a hook replaced): nothing of ours to carry
            _refuse_lower_precision(gathered, sharded, self._root, writer)
            assign_data(sharded, gathered.detach())
        self._seen[unit] = (params, tensor_versions(params))


def track_gathered_writes(
    outer: nn.Module, owned: list[tuple[nn.Module, str]], root: nn.Module, in_step: Callable[[], bool]
) -> tuple[GatheredWrites, list[RemovableHandle]]:
    """The writes a step makes to gathered parameters, followed: the outer unit's (``owned``: recorded as the step
    starts, :meth:`GatheredWrites.begin_step`), and each block unit's, recorded as its forward starts (after FSDP's
    pre-forward hook: gathered by then) and forgotten when its forward ends resharded. ``in_step``: whether a step
    runs (a call outside one gathers nothing it writes to). Returns the writes and the hooks, for their owner."""
    units: list[tuple[Any, list[tuple[nn.Module, str]]]] = [(outer, owned)]
    index_of: dict[int, int] = {}
    hooked: list[tuple[nn.Module, int]] = []
    for module in root.modules():
        groups = fsdp_param_groups(module) if isinstance(module, FSDPModule) else []
        slots = outer_unit_parameters(module) if groups else []
        if not slots:
            continue
        key = id(groups[0])  # the modules of one unit share its parameter group
        if key not in index_of:
            index_of[key] = len(units)
            units.append((module, []))
        units[index_of[key]][1].extend(slots)
        hooked.append((module, index_of[key]))
    writes = GatheredWrites(units, gathered_to_sharded, root)

    def gathered(index: int, module: nn.Module, args: Any) -> None:
        if in_step():
            writes.record(index)

    def ran(index: int, module: nn.Module, args: Any, output: Any) -> None:
        if in_step():
            writes.carry_unit(index, module)

    def done(index: int, module: nn.Module, args: Any, output: Any) -> None:
        if in_step():
            writes.forget_if_resharded(index)

    hooks = [hook for module, index in hooked
             for hook in (module.register_forward_pre_hook(partial(gathered, index)),
                          module.register_forward_hook(partial(ran, index), prepend=True),  # before FSDP2's reshard
                          module.register_forward_hook(partial(done, index)))]
    return writes, hooks


def _refuse_lower_precision(
    written: torch.Tensor, param: torch.Tensor, root: nn.Module, writer: nn.Module | None = None
) -> None:
    if written.dtype == param.dtype:
        return
    name = next((n for n, p in root.named_parameters(remove_duplicate=False) if p is written), "a parameter")
    by = next((f"the forward of `{n}`" for n, m in root.named_modules() if m is writer and n), "`training_step`")
    raise ParameterWriteError(
        f"{by} wrote to `{name}` (in place or by `.data = `) while VitScaleStrategy held its"
        f" {str(written.dtype).removeprefix('torch.')} compute copy: the step computes on copies of the"
        f" {str(param.dtype).removeprefix('torch.')} parameters, gathered for the whole step. Carried back, the write"
        " would round the parameter to the copy's precision every step (an EMA would stall); left there, it would be"
        f" lost at the step's end. {WHERE_WRITES_KEEP_PRECISION}"
    )


def carry_copy_writes(written: list[torch.Tensor], params: list[torch.Tensor], root: nn.Module) -> None:
    """One rank's compute copies written since they were filled (``compute_copies.py``) written to their parameters."""
    for copy_, param in zip(written, params):
        _refuse_lower_precision(copy_, param, root)
        with torch.no_grad():
            dtensor_local(param).copy_(copy_)
