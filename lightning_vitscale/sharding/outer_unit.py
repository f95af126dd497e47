"""The outer FSDP unit, and calls to the sharded model outside a step (callbacks, after ``fit``) that gather it.

Lightning calls ``training_step``, never ``forward``, so the outer unit sits on :class:`OuterUnit`, whose forward
runs the step. Outside a step the outer unit's parameters stay sharded and ``pl_module(x)`` fails inside torch
("got mixed torch.Tensor and DTensor"), where DDP just works; so forward hooks on the modules holding outer-unit
parameters gather it for such a call (blocks gather themselves). The copy is freed when the outermost call returns
under ``no_grad``; with gradients on it is kept (a backward may follow) until the next step, optimizer step or setup.

On one rank with one unit the outer unit holds :class:`~.compute_copies.ComputeCopies` instead: a step swaps them in
(and takes the entry hooks out, which inside a step would only return), a call outside a step swaps them in as it
would gather, and the end of a backward swaps the parameters back.

Such a call is a collective: every rank first states which module it calls (a handshake on the process group's store:
distributed/collective_guard.py); a call on one rank, or different calls, fail with :class:`OutsideStepCallError`,
and nothing is sent on the model's process group. Inside a step, a call of a block some ranks make alone is refused
the same way (sharding/in_step_calls.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import (
    complete_partial_forwards,
    current_backward_id,
    drop_partial_forwards,
    forward_hook_dicts,
    grouped_unit_states,
)
from lightning_vitscale._utils import self_and_ancestors
from lightning_vitscale.distributed import collective_guard
from lightning_vitscale.sharding.buffer_sync import BufferSync
from lightning_vitscale.sharding.compute_copies import ComputeCopies
from lightning_vitscale.sharding.gather_checks import before_gather
from lightning_vitscale.sharding.outer_unit_errors import (
    TRACE_REFUSED,
    BackwardOutsideManualBackwardError,
    outside_step_error,
    unreduced_gradients_message,
)
from lightning_vitscale.sharding.parameter_writes import GatheredWrites, track_gathered_writes
from lightning_vitscale.sharding.unit_members import not_a_unit, outer_unit_parameters, reshard_units


class OuterUnit(nn.Module):
    """The outer FSDP unit around the LightningModule: Lightning's forward redirection calls it, so FSDP's hooks fire
    around the whole step (a ``self(x)`` inside it does not re-enter them)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._in_step = False
        self._depth = 0  # nesting of hooked calls outside a step: only the outermost gathers and frees
        self._gathered_on_demand = False
        self._keep_gathered = False
        self._owned: list[tuple[nn.Module, str]] = []  # (module, name) of each outer-unit parameter
        self._entries: dict[int, str] = {}  # id -> qualified name of each hooked module (what a call names)
        self._hooks: list[Any] = []
        self._entry_hooks: list[tuple[Any, int, Any, bool]] = []  # (hook dict, id, hook, first): toggled with copies
        self._entry_hooks_on = True
        self.buffer_sync: BufferSync | None = None  # a fit's, given by its setup (sharding/buffer_sync.py)
        self.compute_copies: ComputeCopies | None = None  # one rank, nothing to shard (sharding/compute_copies.py)
        self._grouped_states: list[Any] | None = None  # torch 2.11: units of several blocks (_compat)
        self._writes: GatheredWrites | None = None  # FSDP2's path: a step's writes to gathered parameters
        self.deferred_reduction: Any = None  # several ranks, block units: sharding/deferred_reduction.py
        self.in_step_calls: Any = None  # several ranks, block units: sharding/in_step_calls.py

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sync = self.buffer_sync
        if sync is not None:
            sync.before_forward()
        self._in_step = True
        copies = self.compute_copies
        if copies is not None:
            self._gather_for_step()
            copies.keep_memory = True  # until the step's end, for a second backward through its graph
        elif self._writes is not None:
            self._writes.begin_step()
        failed = False
        manual = not getattr(self.module, "automatic_optimization", True)
        try:
            output = self.module(*args, **kwargs)
            self.carry_writes()
            if manual and self._writes is not None:
                self._refuse_unreduced_gradients()
        except BaseException:
            failed = True
            if copies is not None:
                copies.release()  # what the fit's caller sees next are the parameters
            raise
        finally:
            self._in_step = False
            if copies is not None:
                copies.keep_memory = False
                if not failed:  # a failed step's frames (its traceback: pytest's report, a debugger) hold the copies:
                    copies.free()  # their storage resized to 0 under them, printing one read freed memory (a crash)
        if sync is not None:
            sync.after_forward(manual)
        return self._complete_partial_units(output)

    def _refuse_unreduced_gradients(self) -> None:
        """FSDP2's path, at a manual step's end: every backward through ``manual_backward`` ends in the root's
        post-backward, which reduces the outer unit's gradients and reshards it. A gathered outer unit holding
        gradients now had a backward FSDP2 never saw (``loss.backward()`` reaching no block unit)."""
        if not self._owned or self._is_sharded():
            return
        names = {id(module): name for name, module in self.module.named_modules()}
        unreduced = [f"{names.get(id(module), '')}.{name}".lstrip(".") for module, name in self._owned
                     if getattr(module, name).grad is not None]
        if unreduced:
            raise BackwardOutsideManualBackwardError(unreduced_gradients_message(unreduced))

    def carry_writes(self) -> None:
        """Writes the step made to gathered parameters (the outer unit's, block units kept gathered, or one rank's
        compute copies) carried to the parameters (``parameter_writes.py``): at the step's end, and before a
        backward inside it (manual optimization), which frees what was gathered."""
        if self.compute_copies is not None:
            self.compute_copies.carry_writes(self.module)
        elif self._writes is not None:
            self._writes.carry()

    def _complete_partial_units(self, output: Any) -> Any:
        """torch 2.11: a unit of several blocks that ran only some of them in this call is finished here, or its
        next forward would skip gathering it (``_compat.complete_partial_forwards``); nothing to do on later torch."""
        states = self._grouped_unit_states()
        return complete_partial_forwards(states, output) if states else output

    def _drop_partial_units(self) -> None:
        """torch 2.11, as a call starts: a unit one of whose blocks was called alone since (no call of ours ended
        after it) is resharded and forgotten, so this call gathers it (``_compat.drop_partial_forwards``)."""
        states = self._grouped_unit_states()
        if states:
            drop_partial_forwards(states)

    def _grouped_unit_states(self) -> list[Any]:
        if self._grouped_states is None:
            self._grouped_states = grouped_unit_states(self)
        return self._grouped_states

    def no_sync(self) -> AbstractContextManager[None]:
        """DDP's ``no_sync`` on ``trainer.model`` (manual optimization's accumulation habit): backwards inside it
        accumulate as Lightning's micro-batches do (the strategy's ``block_backward_sync``: unreduced where they fit,
        else into the shards), so the step after the first backward outside it sees DDP's averaged sum."""
        lightning_module: Any = self.module
        return lightning_module.trainer.strategy.block_backward_sync()

    # --- calls outside a step ---------------------------------------------------------------------------

    def enable_calls_outside_steps(self) -> None:
        """After ``fully_shard(self)``: hook the modules holding outer-unit parameters and their ancestors."""
        if self._hooks or not isinstance(self, FSDPModule):
            return
        if self._grouped_unit_states():  # torch 2.11 only; before FSDP's pre-forward, which prefetches a block unit
            self._hooks.append(self.register_forward_pre_hook(_drop_partial_units_before_step, prepend=True))
        self._owned = outer_unit_parameters(self.module)
        if self.compute_copies is None:
            self._writes, hooks = track_gathered_writes(self, self._owned, self.module, lambda: self._in_step)
            self._hooks += hooks
        if not self._owned:
            return  # every parameter lives in a block unit: nothing of the outer unit to gather
        # Before FSDP's own pre-forward (prepend): a step starts from the sharded parameters the optimizer
        # updated, never from a copy gathered before that update.
        self._hooks.append(self.register_forward_pre_hook(_release_before_step, prepend=True))
        self._hooks.append(self.register_forward_hook(_reshard_after_eval_step))
        owners = {id(module) for module, _ in self._owned}
        names = {id(module): name for name, module in self.module.named_modules()}
        for module in self_and_ancestors(self.module, owners, descend=not_a_unit):  # blocks gather themselves
            self._entries[id(module)] = names.get(id(module), "")
            self._hooks.append(module.register_forward_pre_hook(self._enter, prepend=True))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))
            pre_hooks, hooks = forward_hook_dicts(module)
            self._entry_hooks += [(pre_hooks, self._hooks[-2].id, self._enter, True),
                                  (hooks, self._hooks[-1].id, self._leave, False)]
        if self.compute_copies is not None:
            self.compute_copies.on_release = self._toggle_entry_hooks

    def _gather_for_step(self) -> None:
        """One rank's compute copies in, for this step; the entry hooks out until they are released (the end of
        backward): in a step they would only return, at a few microseconds per module call."""
        assert self.compute_copies is not None
        self.compute_copies.gather()
        self._toggle_entry_hooks(on=False)

    def _toggle_entry_hooks(self, on: bool = True) -> None:
        if on == self._entry_hooks_on:
            return
        self._entry_hooks_on = on
        for hooks, key, hook, first in self._entry_hooks:
            if not on:
                hooks.pop(key, None)
                continue
            hooks[key] = hook
            if first:
                hooks.move_to_end(key, last=False)

    def release(self) -> None:
        """Free an outer unit gathered by a call outside a step, with any gradients computed on it; one rank's
        compute copies however they were gathered (a step without backward leaves them in)."""
        if self.compute_copies is not None:
            self._gathered_on_demand = False
            self.compute_copies.release()
            return
        if not self._gathered_on_demand:
            return
        self._gathered_on_demand = False
        if self._is_sharded() or not isinstance(self, FSDPModule):
            return  # FSDP resharded it already (e.g. its state-dict hooks)
        for module, name in self._owned:
            getattr(module, name).grad = None  # the unsharded parameter: FSDP would add this to the next step
        reshard_units(self)

    def _is_sharded(self) -> bool:
        module, name = self._owned[0]
        return isinstance(getattr(module, name), DTensor)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._in_step:
            if self.compute_copies is not None and not self.compute_copies.gathered:
                self._gather_for_step()  # a forward after a backward (and optimizer step) in the same step
            elif self.compute_copies is None and self._is_sharded():
                self._gather_again()  # a forward after a backward in the same step (manual optimization)
            return
        if current_backward_id() != -1:  # checkpointing's recompute of a block in this unit: inside a step
            return
        if torch.jit.is_tracing() or torch.compiler.is_exporting():  # would bake gathers and hooks into the graph
            raise RuntimeError(TRACE_REFUSED)
        self._depth += 1
        if self._depth != 1:
            return
        # Blocks gather themselves as the call runs, also when the outer unit is still gathered: always agree first.
        self._agree_on(module)
        self._drop_partial_units()
        if self._is_sharded():
            self._gather()
            self._gathered_on_demand = True
            self._keep_gathered = torch.is_grad_enabled()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._in_step or self._depth == 0:
            return None
        self._depth -= 1
        if self._depth != 0:
            return None
        output = self._complete_partial_units(output)  # a call that ran only some blocks of a unit (torch 2.11)
        if not self._keep_gathered:
            self.release()
        return output

    @torch.compiler.disable
    def _agree_on(self, module: nn.Module) -> None:
        check = collective_guard.fingerprint([self._entries.get(id(module), "")])
        try:
            collective_guard.agree(collective_guard.MODEL_CALL, 0, check)
        except RuntimeError as error:
            raise outside_step_error(error) from error

    @torch.compiler.disable
    def _gather_again(self) -> None:
        """FSDP2's path, a forward after a backward inside the step (a GAN's two updates): that backward's root
        post-backward resharded the outer unit, and the step's own FSDP2 pre-forward ran once, at its start. So the
        unit is gathered here, as the step's start did (no handshake: every rank runs the same step); the backward
        that follows reduces its gradients through the root's pre-backward on its loss
        (:meth:`~.sharded_model.ShardedModel.before_backward`). FSDP2 gathers into the parameters the step started
        with (it keeps them, their storage freed), so the step's writes to them are still followed."""
        assert isinstance(self, FSDPModule)
        self.unshard()

    @torch.compiler.disable
    def _gather(self) -> None:
        assert isinstance(self, FSDPModule)
        if self.compute_copies is not None:
            self.compute_copies.gather()
            return
        try:
            before_gather(self)  # not made in inference mode (gather_checks.py)
            self.unshard()
        except RuntimeError as error:
            raise outside_step_error(error) from error


def _drop_partial_units_before_step(outer: OuterUnit, args: Any) -> None:
    outer._drop_partial_units()


def _release_before_step(outer: OuterUnit, args: Any) -> None:
    outer.release()


def _reshard_after_eval_step(outer: OuterUnit, args: Any, output: Any) -> None:
    # FSDP keeps the outer unit gathered after forward for the backward; an evaluation step has none. Freeing it
    # here (after FSDP's own post-forward) means callbacks between steps, such as on_validation_epoch_end, see
    # the sharded parameters they can update, at one outer-unit all-gather per evaluation step.
    if not torch.is_grad_enabled() and isinstance(outer, FSDPModule):
        reshard_units(outer)
