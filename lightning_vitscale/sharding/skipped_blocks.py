"""Blocks a rank skips in a training step (LayerDrop drawn per rank, a branch on the data): refused before any
gradient is reduced, or trained as DDP's ``find_unused_parameters=True`` trains them.

FSDP2 gathers and reduces each unit's parameters with collectives that every rank joins in the same order. A block
one rank skips breaks that order. Measured on 2 gloo ranks (4 blocks, each skipped with p=0.5 drawn per rank, one
outer unit): the ranks' reduce-scatters differed in size, the step waited out the collective timeout and ended in
gloo's "Connection closed by peer" inside FSDP2's ``foreach_reduce``, naming nothing. With the blocks their own units,
a skipped block's all-gather pairs with the next block's on the other ranks. DDP's default fails at once, naming
``find_unused_parameters=True``.

So, by default, each block's forward pre-hook marks it as run. A mark counts only with gradients on and outside
backward, so evaluation and checkpointing's recompute do not count; and the forward of a reentrant checkpoint
(``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)`` or ``checkpoint_sequential`` in the model's
forward: Swin's and older repositories' way), which runs its blocks without gradients and again in backward, where
an input of the checkpoint requires one.
DDP trains such a model as usual; it was refused at its first backward (and trains as DDP with the mark, measured
on 2 gloo ranks). Before each backward, a rank on which a block holding trainable parameters did not run raises
:class:`SkippedBlocksError`, before it sends any gradient. A model that skips the same blocks on every rank is
refused too, as DDP refuses it. The launcher then stops the ranks left waiting (``distributed.stop_local_ranks``).

With ``find_unused_parameters`` set nothing is refused: under ``True`` every block is in the outer unit, whose
forward every rank runs; under ``"units"`` a rank that skips a block calls it as an identity where it would have
run, so its unit's collectives pair with the other ranks' (``stand_ins.py``).

Inside the units, a parameter one rank leaves unused (an expert another rank routes to, a mask token) would shift
that rank's reduce-scatter against the others': with equal sizes the ranks reduced different tensors into each
other (measured: experts picked per rank, weights wrong from the second step, no error). So on several ranks FSDP2
always reduce-scatters a zero gradient for a parameter this rank did not use, and the replicated fp32 norms do the
same: DDP's ``find_unused_parameters=True`` gradients, at no cost where every parameter is used. A parameter no
rank used then holds a zero gradient (AdamW still decays it), where DDP's flag leaves it none; telling the two apart
takes a collective per backward, which only ``find_unused_parameters=True`` pays: a hook on each gathered parameter
sees whether autograd accumulated into it on this rank (exact, as DDP's walk of the autograd graph), one all-reduce
on the gloo side group ORs that over the ranks, and the parameters no rank used since the last optimizer step get
their gradient back to ``None``, so an optimizer skips them. A first version marked each module whose forward ran
instead; it cleared gradients ``nn.MultiheadAttention`` had put into ``out_proj``, which it uses without calling it
(seen).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale._compat import current_backward_id
from lightning_vitscale.distributed.collective_guard import side_group
from lightning_vitscale.precision import ReplicatedNorms
from lightning_vitscale.sharding.checkpoint_frames import in_a_reentrant_checkpoint


class SkippedBlocksError(RuntimeError):
    """A block holding trainable parameters did not run in a training step's forward on this rank."""


def _trainable(module: nn.Module) -> bool:
    return any(param.requires_grad for param in module.parameters())


class ForwardMarks:
    """Which of ``modules`` ran a training forward (gradients on, not a recompute) since the last :meth:`take`."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self.names = [name for name, _ in modules]
        self.modules = [module for _, module in modules]
        self.ran = [False] * len(modules)
        for index, module in enumerate(self.modules):
            module.register_forward_pre_hook(functools.partial(self._mark, index))

    def _mark(self, index: int, module: nn.Module, args: tuple) -> None:
        if current_backward_id() != -1:  # a recompute
            return
        if torch.is_grad_enabled() or in_a_reentrant_checkpoint():
            self.ran[index] = True

    def take(self) -> list[bool]:
        """The marks so far, and a fresh start."""
        ran, self.ran = self.ran, [False] * len(self.ran)
        return ran


class SkippedBlockCheck:
    """``find_unused_parameters=False``: every block holding trainable parameters ran before each backward."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], rank: int, world_size: int) -> None:
        self.marks = ForwardMarks(blocks)
        self.rank, self.world_size = rank, world_size

    def before_backward(self) -> None:
        ran = self.marks.take()
        skipped = [name for name, did, block in zip(self.marks.names, ran, self.marks.modules)
                   if not did and _trainable(block)]
        if not skipped:
            return
        shown = ", ".join(skipped[:6]) + (f" and {len(skipped) - 6} more" if len(skipped) > 6 else "")
        raise SkippedBlocksError(
            f"VitScaleStrategy: {len(skipped)} of {len(ran)} blocks ({shown}) did not run in this training step's"
            f" forward on rank {self.rank} of {self.world_size} (or ran only without gradients), though they hold"
            " trainable parameters. FSDP gathers and reduces each block's parameters with collectives every rank"
            " must join, so a block some ranks skip (LayerDrop, a branch on the data) would hang the step or mix one"
            " block's parameters with another's. DDP refuses such a model too. Pass"
            " VitScaleStrategy(find_unused_parameters=True), as strategy='ddp_find_unused_parameters_true' under DDP:"
            " every block then stays in the outer unit, gathered for the step (find_unused_parameters=\"units\" keeps"
            " them in units for a model too large to gather whole). If the blocks are not trained, set"
            " requires_grad=False on their parameters instead."
        )

    def reset(self) -> None:
        """A training step starts: marks from calls outside it (a callback's) do not count."""
        self.marks.take()


class UnusedParameters:
    """Several ranks, ``find_unused_parameters=True``: the parameters no rank used since the last optimizer step
    keep no gradient, as DDP leaves them. ``units``: each FSDP unit and (module, name) of each
    parameter it shards; ``norms``: the replicated fp32 norms.

    Used means autograd accumulated a gradient into the parameter on this rank, seen by a hook on each gathered
    parameter, hooked from its unit's forward pre-hook (after FSDP2's, so the module holds the gathered tensor).
    FSDP2 reuses the same gathered tensor every step, so each is hooked once; one never seen gathered counts as used.
    A norm is used where it holds a gradient before the zeros are filled in (``ReplicatedNorms.filled``)."""

    def __init__(self, units: list[tuple[nn.Module, list[tuple[nn.Module, str]]]], norms: ReplicatedNorms | None):
        self.owned = [slot for _, slots in units for slot in slots]
        self.norms = norms
        self.used = [False] * len(self.owned)
        self.watched = [False] * len(self.owned)
        self._hooked: dict[int, torch.Tensor] = {}  # id -> the gathered tensor, kept so that its id stays its own
        first = 0
        for unit, slots in units:
            unit.register_forward_pre_hook(functools.partial(self._watch, range(first, first + len(slots))))
            first += len(slots)

    def _watch(self, indices: range, unit: nn.Module, args: object) -> None:
        for index in indices:
            if self.watched[index]:
                continue
            module, name = self.owned[index]
            tensor = getattr(module, name)
            if isinstance(tensor, DTensor) or not tensor.requires_grad or id(tensor) in self._hooked:
                continue
            self._hooked[id(tensor)] = tensor
            tensor.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))
            self.watched[index] = True

    def _accumulated(self, index: int, tensor: torch.Tensor) -> None:
        self.used[index] = True

    def after_backward(self) -> int:
        """Clear the gradients of the parameters no rank used; returns how many were cleared."""
        params = [getattr(module, name) for module, name in self.owned]
        flags = [used or not watched for used, watched in zip(self.used, self.watched)]
        if self.norms is not None and self.norms.filled:  # this backward reduced the norms
            params += self.norms.params
            flags += [not zeroed for zeroed in self.norms.filled]
            self.norms.filled = []
        cleared = 0
        for param, anywhere in zip(params, _on_any_rank(flags)):
            if not anywhere and param.grad is not None:
                param.grad = None
                cleared += 1
        return cleared

    def after_optimizer_step(self) -> None:
        self.used = [False] * len(self.used)


def _on_any_rank(flags: list[bool]) -> list[bool]:
    """``flags`` OR-ed over the ranks, on the gloo side group (a host tensor: no device sync)."""
    group = side_group()
    if group is None or not flags:
        return flags
    values = torch.tensor(flags, dtype=torch.uint8)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return [bool(value) for value in values.tolist()]


def zero_gradients_for_unused(outer: object, required: bool) -> None:
    """FSDP2 reduce-scatters a zero gradient for a parameter this rank did not use, in every unit, so every rank's
    collectives have the same sizes in the same order (FSDP2's ``set_reduce_scatter_unused_params``, which torch
    2.14 has). ``required``: ``find_unused_parameters`` set, which cannot work without it."""
    setter = getattr(outer, "set_reduce_scatter_unused_params", None)
    if setter is not None:
        setter(True)
    elif required:
        raise RuntimeError(
            f"VitScaleStrategy(find_unused_parameters=...) needs FSDP2's set_reduce_scatter_unused_params, which"
            f" torch {torch.__version__} lacks: upgrade torch (it is in 2.14), or make every rank run every block."
        )
