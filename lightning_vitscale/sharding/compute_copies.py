"""One rank, nothing to shard: the step computes on copies of the parameters made in one foreach copy per dtype, and
their gradients come back in one, instead of FSDP2's per-parameter path.

On one rank FSDP2 still runs its whole machinery per parameter each step: cast and copy into a gathered buffer,
re-register the unsharded parameter, concatenate the gradients, "reduce-scatter" (a copy), re-wrap each as a DTensor
and reshard: most of the host time a ViT-H-deep step spent beyond plain AMP's (benchmarks/RESULTS.md, issue 47).
Here the parameters stay fp32 DTensors on the one-rank mesh (checkpoints, clipping, EMA and the optimizer see what
they see on N ranks) and FSDP2 ignores them. For a step the modules hold :class:`ComputeCopies`' ``nn.Parameter``
views of one flat buffer per dtype (FSDP2's own trick: the buffer's storage is freed between steps, the views stay
valid): the compute dtype's copies, and the fp32 norms' in fp32 (their forward then only casts the input). At the end
of each backward each gradient is cast onto its fp32 DTensor parameter (or added to an accumulation window's) and
the modules get their DTensor parameters back. The numbers are FSDP2's bit for bit: the same casts,
fp32 sums in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_vitscale._compat import (
    current_backward_id,
    dtensor_like,
    dtensor_local,
    foreach_add_,
    foreach_copy_,
    parameter_slots,
    queue_end_of_backward,
    tensor_version,
)
from lightning_vitscale.precision.flat_step import FlatGroup
from lightning_vitscale.sharding.parameter_writes import AssignableParameter, carry_copy_writes

Slot = tuple[nn.Module, str, int]  # owner, attribute, index of its parameter


def to_row_shards(root: nn.Module, mesh: DeviceMesh, device: torch.device, skip: set[int]) -> list[nn.Parameter]:
    """Every parameter under ``root`` not in ``skip`` (ids) made a DTensor laid out as ``fully_shard`` lays it out
    (``Shard(0)``, replicated along a 2-D mesh's first dimension), on ``device``, values aliased; a tied parameter
    stays one. Returns them."""
    made: dict[int, nn.Parameter] = {}
    placements = (*(Replicate() for _ in range(mesh.ndim - 1)), Shard(0))  # a 2-D mesh: hybrid sharding's
    for module in root.modules():
        params = parameter_slots(module)
        for name, param in list(params.items()):
            if param is None or id(param) in skip or isinstance(param, DTensor):
                continue
            if id(param) not in made:  # no 0-dim or complex one: held replicated (scalar_parameters.py)
                local = param.detach() if param.is_meta else param.detach().to(device)  # meta: the init fills it
                sharded = DTensor.from_local(local, mesh, placements, run_check=False)
                made[id(param)] = nn.Parameter(sharded, requires_grad=param.requires_grad)
            params[name] = made[id(param)]
    return list(made.values())


class _Group:
    """The copies of one dtype: views of one flat buffer, whose storage exists only while gathered."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype) -> None:
        self.params = params
        sizes = [p.numel() for p in params]
        self.flat = torch.empty(sum(sizes), dtype=dtype, device=dtensor_local(params[0]).device)
        storage = self.flat.untyped_storage()
        self.nbytes = storage.nbytes()
        # Tensors on the buffer's storage, not views of it: each keeps a version counter of its own, as a parameter
        # under DDP does, so a step's write to one copy (a momentum encoder's) neither trips autograd's check on
        # another saved for backward nor hides which one was written (``parameter_writes.py``, whose ``.data = v``
        # setter the copies get).
        offsets = [0, *itertools.accumulate(sizes)]
        self.copies: list[torch.Tensor] = [
            AssignableParameter(self.flat.new_empty(0).set_(storage, offset, p.shape, _contiguous_strides(p.shape)),
                                requires_grad=p.requires_grad)
            for offset, p in zip(offsets, params)
        ]
        self.filled_versions: list[int] = []  # each copy's version after the last fill: a later one, a step's write
        storage.resize_(0)

    @torch.no_grad()
    def fill(self) -> None:
        storage = self.flat.untyped_storage()
        if storage.nbytes() != self.nbytes:
            storage.resize_(self.nbytes)
        foreach_copy_(self.copies, [dtensor_local(p) for p in self.params])
        self.filled_versions = [tensor_version(copy) for copy in self.copies]

    def carry_writes(self, root: nn.Module) -> None:
        written = [i for i, (copy, version) in enumerate(zip(self.copies, self.filled_versions))
                   if tensor_version(copy) != version]
        if written:
            carry_copy_writes([self.copies[i] for i in written], [self.params[i] for i in written], root)
            self.filled_versions = [tensor_version(copy) for copy in self.copies]

    def free(self) -> None:
        storage = self.flat.untyped_storage()
        if storage.resizable():  # `.numpy()` of a copy in a step (CPU) shares it with NumPy: kept, filled as it is
            storage.resize_(0)


def _contiguous_strides(shape: torch.Size) -> list[int]:
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return strides


class ComputeCopies:
    """The copies a one-rank step computes on (see the module docstring). ``gathered``: the modules hold them, from
    :meth:`gather` to :meth:`release` (a step's forward to the end of its backward, an evaluation step, a call
    outside a step). ``on_release``: called after each release (the outer unit's hooks for calls outside steps)."""

    def __init__(self, root: nn.Module, params: list[nn.Parameter], compute: torch.dtype) -> None:
        """``params``: the DTensor parameters under ``root`` to stand in for. Row-sharded ones (the low-precision
        layers') compute in ``compute``; replicated ones (the fp32 norms, ``precision/norms.py``) in their own dtype."""
        index = {id(p): i for i, p in enumerate(params)}
        self._slots: list[Slot] = [(m, n, index[id(p)]) for m in root.modules()
                                   for n, p in parameter_slots(m).items() if p is not None and id(p) in index]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, param in enumerate(params):
            row_sharded = isinstance(param, DTensor) and isinstance(param.placements[-1], Shard)
            by_dtype.setdefault(compute if row_sharded else param.dtype, []).append(i)
        self.params = params
        self._dtypes = [param.dtype for param in params]  # the gradients' (a parameter's dtype never changes here)
        self._groups = [_Group([params[i] for i in members], dtype) for dtype, members in by_dtype.items()]
        self.copies: list[torch.Tensor] = [torch.empty(0)] * len(params)
        for group, members in zip(self._groups, by_dtype.values()):
            for i, copy in zip(members, group.copies):
                self.copies[i] = copy
        self._hooked: set[int] = set()
        for copy in self.copies:
            self._follow_requires_grad(copy, copy.requires_grad)
        self._flat: list[tuple[list[torch.Tensor], FlatGroup]] = []  # groups stepped flat: their params' copies
        self._queued_in = -1
        self.gathered = False
        self.on_release: Callable[[], None] | None = None
        self.keep_memory = False  # the outer unit's step: a backward in it (manual optimization) may be run again

    def use_flat_gradients(self, groups: Sequence[FlatGroup]) -> None:
        """The gradients of each of ``groups``' parameters handed over into views of one buffer laid out as its flat
        masters, so the optimizer steps the group as one tensor (``precision/flat_step.py``); per tensor where one
        of them has no gradient or already holds one (accumulation onto a gradient kept from before)."""
        copy_of = {id(p): copy for p, copy in zip(self.params, self.copies)}
        self._flat = [([copy_of[id(p)] for p in group.params], group) for group in groups
                      if all(id(p) in copy_of for p in group.params)]

    def gather(self) -> None:
        """The modules compute on fresh copies of the parameters' current values (also when already gathered: a step
        whose backward never came, or an optimizer step since, must not leave stale copies)."""
        for group in self._groups:
            group.fill()
        for copy, param in zip(self.copies, self.params):
            if copy.requires_grad != param.requires_grad:  # frozen or unfrozen since (a fine-tuning callback)
                self._follow_requires_grad(copy, param.requires_grad)
        copies = self.copies
        for module, name, index in self._slots:
            parameter_slots(module)[name] = copies[index]
        self.gathered = True

    def _follow_requires_grad(self, copy: torch.Tensor, requires_grad: bool) -> None:
        copy.requires_grad_(requires_grad)
        if requires_grad and id(copy) not in self._hooked:  # a hook needs requires_grad: registered when it first does
            copy.register_post_accumulate_grad_hook(self._arrived)
            self._hooked.add(id(copy))

    def release(self) -> None:
        """The modules get their DTensor parameters back; the copies' memory is freed, unless :attr:`keep_memory`
        (a backward inside a step: :meth:`free` at the step's end)."""
        if not self.gathered:
            return
        params = self.params
        for module, name, index in self._slots:
            parameter_slots(module)[name] = params[index]
        for copy in self.copies:
            if copy.grad is not None:  # left by a backward that raised: dropped
                copy.grad = None
        self.gathered = False
        if not self.keep_memory:
            self.free()
        if self.on_release is not None:
            self.on_release()

    def carry_writes(self, root: nn.Module) -> None:
        """Writes to the copies since they were filled (a ``training_step`` updating a momentum encoder, normalizing
        a weight) carried to the parameters: the copies are this step's, refilled at the next."""
        if not self.gathered:
            return
        for group in self._groups:
            group.carry_writes(root)

    def free(self) -> None:
        """The copies' memory, unless the modules hold them. A graph kept for a second backward
        (``manual_backward(loss, retain_graph=True)``) saved the copies: freed, they could not be read again."""
        if not self.gathered:
            for group in self._groups:
                group.free()

    def _arrived(self, _copy: torch.Tensor) -> None:
        backward = current_backward_id()
        if backward != self._queued_in:  # once per backward, however it was called (a raw loss.backward() too)
            self._queued_in = backward
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.hand_over_gradients()
        self.release()

    @torch.no_grad()
    def hand_over_gradients(self) -> None:
        """The copies' gradients, cast to each parameter's dtype, onto the DTensor parameters (summed into any there,
        as autograd would): a flat group's into views of one buffer laid out as its masters (one foreach cast), the
        others one cast per tensor (on CPU a foreach copy is no fused kernel: the casts cost the same either way)."""
        for copies, group in self._flat:
            grads = [g for g in (copy.grad for copy in copies) if g is not None]
            if (len(grads) != len(copies) or any(p.grad is not None for p in group.params)
                    or not all(p.requires_grad for p in group.params)):
                continue
            views = group.gradient_views()
            foreach_copy_(views, grads)
            for copy, master, view in zip(copies, group.params, views):
                copy.grad = None
                master.grad = dtensor_like(view, master)
        onto: list[torch.Tensor] = []
        added: list[torch.Tensor] = []
        for param, copy, dtype in zip(self.params, self.copies, self._dtypes):
            grad = copy.grad
            if grad is None:
                continue
            copy.grad = None  # not summed into the next backward's (a second one through a kept graph comes later)
            if not param.requires_grad:  # frozen during the step (`toggle_optimizer`): no gradient, as under DDP
                continue
            held = param.grad
            if held is None:
                param.grad = dtensor_like(grad.to(dtype), param)
            else:
                onto.append(dtensor_local(held))
                added.append(grad)
        if added:
            foreach_add_(onto, added)
