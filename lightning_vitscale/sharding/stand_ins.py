"""Blocks a rank skips under ``find_unused_parameters="units"`` (LayerDrop drawn per rank, a branch on the data),
each in an FSDP unit of its own or grouped: the rank calls the skipped block as an identity where it would have run,
so its unit's collectives pair with the other ranks' as if it had. (``True`` keeps every block in the outer unit.)

FSDP2 gathers a unit's parameters in its pre-forward and reduces their gradients in its post-backward, with
collectives every rank joins in the same order. A block one rank skips would pair its next block's all-gather with
the skipped one's on the other ranks (measured: the step hung, then gloo's "Connection closed by peer"). In the outer
unit (``True``) every block is gathered whole: a model too large for one device cannot skip blocks so.

Mid-forward: each block in a unit gets a forward pre-hook (before FSDP2's) that knows the blocks' order. Calling
block ``j`` after block ``i < j - 1`` means blocks ``i+1 .. j-1`` were skipped; each is called first with its
``forward`` replaced by an identity on the tensor about to enter block ``j``: FSDP2's hooks gather its unit (or take
the gather its predecessor prefetched), reshard it and hook its backward as for a real call. The identity's output
is joined behind that tensor (:class:`_Join`: the value passes unchanged, a copy; the stand-in gets a zero
gradient), so in backward the stand-in runs after block ``j`` and before block ``i``, where the other ranks reduce
the skipped block's gradients: its unit reduces zeros for them (``set_reduce_scatter_unused_params``), DDP's
``find_unused_parameters=True`` sum. A block called at or before the last one called starts a new forward (a second
crop): the last forward's remaining blocks are stood in for first.

At a forward's end: the blocks after the last one called are stood in for (each on an empty leaf) before anything
else could wait: at the first collective the step sends through Lightning (``self.log(..., sync_dist=True)``,
``self.all_gather``: the strategy calls :meth:`StandIns.finish_forward`; a rank that waited there while another
waits in that block's all-gather was seen to hang the step), else when the outermost call into the model ends,
before FSDP2's post-forward (without gradients it reshards every unit, a prefetched gather included, which a
later stand-in would send again). Their outputs are joined behind the step's output (the loss), under FSDP2's root
backward hook, so their backward runs first in backward, as the last blocks' do on the other ranks; a backward
inside the step (manual optimization) joins them to its loss (:meth:`StandIns.on_loss`). A collective the step
sends itself (``torch.distributed``) after a skipped last block still waits for the ranks that run it: send it
through Lightning's ``self.all_gather`` / ``self.log``.

It holds for stacks whose blocks feed only the next one. Where a block's input also comes from a shared path (HF's
Conditional DETR: decoder layers cross-attending to one encoder memory), FSDP2's post-backward of the layer after a
skipped one waits on that path, which the stand-in changes: the ranks' reduce-scatters came in another order and the
step hung. Hence opt-in, and blocks held alone, outside a stack (:func:`not_in_a_stack`), stay in the outer unit.

This takes every forward to call the blocks in the order the model registers them (a stack's), each once: the
order a forward of a LayerDrop model shows varies by rank and step (the step measured at setup skipped blocks too),
so no recorded order is more reliable. The only block in units called again in one forward (one block every layer
shares) raises :class:`RepeatedBlockError`: a rank that skips some of its calls cannot be stood in for, since
nothing says how many calls the others made.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_vitscale._compat import current_backward_id
from lightning_vitscale._utils import parents


class RepeatedBlockError(RuntimeError):
    """A block in a unit called twice in a row under ``find_unused_parameters="units"`` on several ranks."""


class _Join(torch.autograd.Function):
    """``tensor`` unchanged (a copy: an in-place write by the next block must not meet a custom Function's view),
    with ``stand_in`` (a stood-in block's output) behind it in the graph: its gradient is zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, stand_in: torch.Tensor) -> torch.Tensor:
        ctx.stand_in = stand_in.shape, stand_in.dtype, stand_in.device
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.stand_in
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _identity(anchor: torch.Tensor | None, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A stood-in block's forward: ``tensor`` as it came through FSDP2's pre-forward. Its output requires a gradient
    as the block's would (its parameters do), so FSDP2 hooks the unit's backward; ``anchor`` (a zero) makes it so
    where ``tensor`` does not (the first block after a frozen stem)."""
    if anchor is not None and not tensor.requires_grad:
        return tensor + anchor.to(tensor.dtype)
    return tensor.view_as(tensor)


class StandIns:
    """The blocks in units (``blocks``, in the order a forward calls them) and the module every call into the model
    enters (``root``: the outer unit); see the module docstring."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], root: nn.Module) -> None:
        self.names = [name for name, _ in blocks]
        self.blocks = [block for _, block in blocks]
        self.next = 0  # the block a forward calls next if none is skipped (0: none called yet)
        self.stood_in = 0  # how many stand-ins ran (tests)
        self._pending: list[torch.Tensor] = []  # stand-ins after a forward's last block, for the loss to join
        self._with_grad = False  # whether the forward under way runs with gradients (its backward is to come)
        self._standing = False
        self._depth = 0  # calls into the root running
        for index, block in enumerate(self.blocks):  # prepended after FSDP2's: these run first
            block.register_forward_pre_hook(functools.partial(self._before_block, index), prepend=True,
                                            with_kwargs=True)
        root.register_forward_pre_hook(self._enter, prepend=True)
        # Before FSDP2's post-forward: without gradients it reshards every unit, a gather prefetched for the skipped
        # block included, which the stand-in would then send again, one all-gather more than the other ranks.
        root.register_forward_hook(self._leave, prepend=True, always_call=True)

    def _before_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._standing or current_backward_id() != -1:  # a stand-in's own call; checkpointing's recompute
            return None
        if index == self.next - 1 and len(self.blocks) == 1:
            raise RepeatedBlockError(
                f"VitScaleStrategy(find_unused_parameters=\"units\"): block {self.names[index]}, the only one in a"
                " unit, ran twice in one forward. A block a rank skips is called as an identity where the other ranks"
                " run it, so that its FSDP unit's collectives pair up; a block whose weights several layers share"
                " cannot be: a rank that skips some of its calls cannot tell how many the others made. Leave it out"
                " of `blocks=`, or pass find_unused_parameters=True (every block in the outer unit, gathered for the"
                " whole step)."
            )
        if index < self.next:  # a new forward: the last one's remaining blocks first
            skipped = [*range(self.next, len(self.blocks)), *range(index)]
        else:
            skipped = list(range(self.next, index))
        self.next, self._with_grad = index + 1, torch.is_grad_enabled()
        if not skipped:
            return None
        position, tensor = _first_tensor(args, kwargs)
        if tensor is None:  # nothing to join them to: to the loss, as after a forward's last block
            self._pending += self._stand_in(skipped, None)
            return None
        joined = self._stand_in(skipped, tensor)[-1]
        if isinstance(position, int):
            return (*args[:position], joined, *args[position + 1:]), kwargs
        return args, {**kwargs, position: joined}

    def finish_forward(self, dropped: bool = False) -> None:
        """The blocks this forward has not called are stood in for now, before any other collective: another rank
        may be waiting in its gather for a block this one skipped (its forward's last), and a collective of the
        user's in between (``self.log(..., sync_dist=True)``: ``strategy.reduce``, which Lightning runs without
        gradients) would wait for that rank. Their backward waits for the loss (:meth:`on_loss`), unless the
        forward's graph was ``dropped``."""
        if not self.next or self._standing:
            return
        skipped, self.next = list(range(self.next, len(self.blocks))), 0
        if skipped:
            with torch.set_grad_enabled(self._with_grad and not dropped):
                self._pending += self._stand_in(skipped, None)

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the strategy's backward runs from, with this forward's stand-ins after its last block joined:
        their backward (gather and reduce-scatter) runs first, where the other ranks run those blocks' backward."""
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return loss
        self.finish_forward()
        pending, self._pending = self._pending, []
        return functools.reduce(self._join, reversed(pending), loss) if pending else loss

    def _enter(self, *unused: Any) -> None:
        self._depth += 1
        if self._depth == 1:  # a forward left without a backward (its graph dropped): its stand-ins go with it
            self.finish_forward(dropped=True)
            self._pending = []

    def _leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The outermost call's end: a forward without gradients stands in for its last blocks (nothing else will);
        one with gradients joins its stand-ins into the output the loss is, before FSDP2's post-forward hooks it:
        FSDP2's root backward (a prefetch of the last block's gather in it) then runs first, as on the other ranks,
        where on the loss (:meth:`on_loss`) the stand-ins' backward would run before it."""
        self._depth -= 1
        if self._depth:
            return None
        self.finish_forward()
        if not self._pending:
            return None
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return None  # manual optimization's backward ran already, or runs from another tensor: on_loss
        joined = functools.reduce(self._join, reversed(self._pending), loss)
        self._pending = []
        return {**output, "loss": joined} if isinstance(output, dict) else joined

    def _stand_in(self, indices: list[int], tensor: torch.Tensor | None) -> list[torch.Tensor]:
        """Each block of ``indices`` called as an identity: on ``tensor``, each stand-in's output joined behind it
        for the next (returns ``[tensor]`` with every stand-in behind it: in backward the last block's first), or,
        where ``None``, each on an empty leaf of its own (returns their outputs)."""
        outputs: list[torch.Tensor] = []
        grad = torch.is_grad_enabled()
        self._standing = True
        try:
            for index in indices:
                block = self.blocks[index]
                if tensor is None:
                    source = torch.zeros(0, device=_device_of(block), requires_grad=grad)
                else:
                    source = tensor
                anchor = torch.zeros((), device=source.device, requires_grad=True) \
                    if grad and not source.requires_grad else None
                saved = block.__dict__.get("forward")
                block.forward = functools.partial(_identity, anchor)  # type: ignore[method-assign]
                try:
                    output = block(source)
                finally:
                    if saved is None:
                        del block.forward
                    else:
                        block.forward = saved  # type: ignore[method-assign]
                self.stood_in += 1
                if not (grad and isinstance(output, torch.Tensor) and output.requires_grad):
                    continue
                if tensor is None:
                    outputs.append(output)
                else:
                    tensor = _Join.apply(tensor, output)
            return outputs if tensor is None else [tensor]
        finally:
            self._standing = False

    @staticmethod
    def _join(tensor: torch.Tensor, stand_in: torch.Tensor) -> torch.Tensor:
        """``tensor``'s value with a stand-in's output behind it in the graph."""
        return _Join.apply(tensor, stand_in)


def _device_of(block: nn.Module) -> torch.device:
    return next(iter(block.parameters()), torch.empty(0)).device


def _first_tensor(args: tuple, kwargs: dict) -> tuple[int | str | None, torch.Tensor | None]:
    """Where the first floating tensor argument of a call is (a position or a keyword), and the tensor."""
    for position, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return position, value
    return None, None


def finishing_forward(collective: Callable[..., Any]) -> Callable[..., Any]:
    """A strategy's collective (``reduce``, ``all_gather``, ``broadcast``) that first finishes the forward under way
    (:meth:`StandIns.finish_forward`) where the strategy's sharded model stands in for skipped blocks."""

    @functools.wraps(collective)
    def after_stand_ins(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        stand_ins = getattr(getattr(strategy, "sharded", None), "stand_ins", None)
        if stand_ins is not None:
            stand_ins.finish_forward()
        return collective(strategy, *args, **kwargs)

    return after_stand_ins


def joining_on_loss(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A strategy's ``backward(loss, ...)`` from the loss with the stand-ins of the forward under way joined
    (:meth:`StandIns.on_loss`)."""

    @functools.wraps(backward)
    def from_joined_loss(strategy: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        stand_ins = getattr(getattr(strategy, "sharded", None), "stand_ins", None)
        return backward(strategy, loss if stand_ins is None else stand_ins.on_loss(loss), *args, **kwargs)

    return from_joined_loss


def not_in_a_stack(blocks: Sequence[tuple[str, nn.Module]], model: nn.Module) -> list[str]:
    """The blocks that are no member of a stack (a ``ModuleList`` / ``Sequential`` / ``ModuleDict`` holding two or
    more of the blocks, as LayerDrop's ``for layer in self.layers``): a block held alone (Conditional DETR's
    ``query_scale`` head, called before every decoder layer but the first, so as often as they run) has no order to
    be stood in by, so it stays in the outer unit, which every rank gathers once a step."""
    parent_of = parents(model)
    stacks = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    members: dict[int, int] = {}
    for _, block in blocks:
        parent = parent_of.get(id(block))
        if isinstance(parent, stacks):
            members[id(parent)] = members.get(id(parent), 0) + 1
    return [name for name, block in blocks if members.get(id(parent_of.get(id(block))), 0) < 2]
