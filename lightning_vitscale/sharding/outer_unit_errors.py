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


class ForwardAfterBackwardError(RuntimeError):
    """A forward after a backward in the same step found the outer unit resharded (several ranks, FSDP2's path)."""


class SecondBackwardError(RuntimeError):
    """A second backward through a graph kept with ``retain_graph=True`` found the parameters it saved freed
    (several ranks, FSDP2's path)."""


FORWARD_AFTER_BACKWARD = (
    "A forward after a backward in the same `training_step` (manual optimization updating twice, e.g."
    " a GAN's generator then discriminator) is not supported by VitScaleStrategy where FSDP2 runs"
    " the step (several ranks, or one device with units of their own: `priority=\"memory\"`, a"
    " pinned `blocks_per_unit` or `reshard_after_forward`): FSDP2 resharded the outer unit at the end"
    " of that backward, and nothing inside the step gathers it again (DDP has no such state). Run"
    " each update in its own `training_step` (e.g. alternate them by `batch_idx`), or train this"
    " module with strategy='ddp', or on one device with `VitScaleStrategy()`'s defaults (one unit on"
    " compute copies), which support it."
)


def outside_step_error(error: RuntimeError) -> OutsideStepCallError:
    """The error a call outside a step raises when the ranks did not all make it (``error``: the guard's)."""
    return OutsideStepCallError(collective_guard.not_joined(
        "Calling the sharded model outside a training/validation step gathers its outer FSDP unit", error,
        "Make the same call on every rank (not under `if trainer.is_global_zero:` or `@rank_zero_only`), or make it"
        " inside a `*_step`.",
    ))
