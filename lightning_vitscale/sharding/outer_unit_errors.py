"""The errors of calls into the sharded model that DDP would run and the outer unit cannot, each naming its fix."""

from __future__ import annotations

from lightning_vitscale.distributed import collective_guard


class OutsideStepCallError(RuntimeError):
    """Gathering the outer unit for a call outside a step failed, most often because not every rank called."""


TRACE_REFUSED = (
    "torch.jit.trace / torch.export / torch.onnx.export of a model sharded by VitScaleStrategy would record its"
    " shards and the strategy's gathers. Trace DDP's plain module instead: `plain = copy.deepcopy(model).eval()`"
    " (on every rank: it gathers the parameters), then `torch.jit.trace(plain, x)`, `torch.export.export(plain,"
    " (x,))` or `torch.onnx.export(plain, ...)`; for a checkpoint folder, `python -m lightning_vitscale export`."
)


class InStepCallError(RuntimeError):
    """A block called more often in a step on some ranks than on others (``if trainer.is_global_zero: self(x)`` in a
    ``*_step``): its gathers would pair with other collectives of the other ranks."""


def in_step_call_error(block: str, count: int, error: RuntimeError) -> InStepCallError:
    """The error of the ``count``-th call of ``block`` in a step, which not every rank made (``error``: the guard's)."""
    nth = {2: "2nd", 3: "3rd"}.get(count, f"{count}th")
    return InStepCallError(collective_guard.not_joined(
        f"Calling `{block}` a {nth} time in this step (a block FSDP unit: each call gathers its sharded weights)",
        error,
        "Make the same calls of the model in a step on every rank (not under `if trainer.is_global_zero:` or"
        " `@rank_zero_only`): call the model on every rank and log on rank 0 only, or log what the step already"
        " computed. DDP's calls are local; here a call on one rank would pair its gathers with the other ranks' next"
        " collectives. (Where the extra call came first in the step, it ran, and this is the step's own call.)",
    ))


class SecondBackwardError(RuntimeError):
    """A second backward through a graph kept with ``retain_graph=True``, run outside ``manual_backward``, found the
    parameters it saved freed (several ranks, FSDP2's path)."""


class BackwardOutsideManualBackwardError(RuntimeError):
    """A backward in a manual-optimization step ran outside ``manual_backward`` and reached only the outer unit's
    parameters: their gradients were never averaged over the ranks (FSDP2's path)."""


def unreduced_gradients_message(names: list[str]) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        "A backward in `training_step` ran outside `self.manual_backward(...)` (e.g. `loss.backward()`), and no"
        f" FSDP unit saw it: the gradients of {shown} were never averaged over the ranks or handed to the sharded"
        " parameters, so the optimizer stepped without them (DDP's hooks on every parameter need no such call)."
        " Call `self.manual_backward(loss)` for every backward, as Lightning's manual optimization asks: the strategy"
        " hooks the backward it runs."
    )


def outside_step_error(error: RuntimeError) -> OutsideStepCallError:
    """The error a call outside a step raises when the ranks did not all make it (``error``: the guard's)."""
    return OutsideStepCallError(collective_guard.not_joined(
        "Calling the sharded model outside a training/validation step gathers its outer FSDP unit", error,
        "Make the same call on every rank (not under `if trainer.is_global_zero:` or `@rank_zero_only`), or make it"
        " inside a `*_step`.",
    ))
