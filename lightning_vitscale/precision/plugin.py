"""VitScalePrecision: the Lightning precision plugin that owns the dtype policy (which dtype where)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import Optimizable, Steppable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_vitscale._compat import after_closure, buffer_slots, unscales_in_step
from lightning_vitscale.precision.casting import (
    autocast_around,
    floating_buffers,
    refuse_low_precision_statistics,
    to_dtype,
)
from lightning_vitscale.precision.clipping import clip_grad_norm
from lightning_vitscale.precision.elementwise import holds_whole_parameters, skips_on_device, steps_locally
from lightning_vitscale.precision.grad_scaler import ShardedGradScaler
from lightning_vitscale.precision.library_ops import AutocastOp, as_under_autocast, found_ops
from lightning_vitscale.precision.local_step import lbfgs_on_whole_locals, on_local_shards
from lightning_vitscale.precision.nonfinite import NonFiniteGuard
from lightning_vitscale.precision.parametrizations import compute_parametrizations_in
from lightning_vitscale.precision.settings import (
    SUPPORTED_FLAGS,
    NormSelector,
    PrecisionFlag,
    norm_predicate,
    resolve_flag,
)
from lightning_vitscale.precision.step_autocast import step_under_autocast

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Lightning's generic plugins that only carry a flag; anything more specific is the user's choice to keep.
_M = TypeVar("_M", bound=nn.Module)
_TRANSLATABLE: tuple[type[Precision], ...] = (Precision, MixedPrecision, HalfPrecision)


class VitScalePrecision(Precision):
    """BF16 "O2" for sharded models: low-precision compute on fp32 master weights, norms kept in fp32. Made from
    ``Trainer(precision=...)`` under VitScaleStrategy; construct it yourself for finer control.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"`` (O2), ``"bf16-true"`` or ``"16-mixed"`` (O2 in fp16 with a
            sharded gradient scaler).
        compute_dtype: override the dtype units compute in.
        reduce_dtype: override the dtype gradients are reduced in.
        norm_dtype: dtype normalization layers keep (parameters and compute); ``None`` follows the model.
        norms: which modules are normalization layers: ``None``/``True`` detects them (torch norms, subclasses,
            modules calling ``F.layer_norm``-style functionals, ``...Norm`` classes), a set of classes, a
            predicate ``(name, module)``, or ``False`` for none.
        skip_nonfinite: skip, on every rank, an optimizer step whose loss or gradients are inf/NaN on any rank
            (under ``"16-mixed"`` only the loss: the scaler owns the gradients). ``None``: on for the bf16 and
            fp16 flags, off for ``"32-true"`` (which then steps as under DDP). See docs/precision.md.
        max_skipped_steps: with the guard on, stop with ``NonFiniteTrainingError`` after this many skipped steps in
            a row (no NaN reaches the weights or a checkpoint).
        full_precision: qualified names of modules kept in ``norm_dtype`` beside the norms under the mixed flags, as
            DDP's AMP computes a module its step runs inside ``torch.autocast(..., enabled=False)``. Setup finds those
            itself when it runs the step on a batch; name them here where it cannot (a stream it cannot read ahead).
        device: the device type of the step's autocast under the mixed flags (the step's own code computes as under
            DDP's AMP, the model's layers as O2), as Lightning's ``MixedPrecision(device=...)``; ``None``: ``"cuda"``
            where available, else ``"cpu"``.

    Example::

        Trainer(strategy=VitScaleStrategy(), plugins=[VitScalePrecision("bf16-mixed", reduce_dtype=torch.bfloat16)])
    """

    def __init__(
        self,
        precision: PrecisionFlag = "32-true",
        *,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        norm_dtype: torch.dtype | None = torch.float32,
        norms: NormSelector = None,
        skip_nonfinite: bool | None = None,
        max_skipped_steps: int = 3,
        full_precision: Collection[str] = (),
        device: str | None = None,
    ) -> None:
        base = resolve_flag(precision)
        self.precision = precision  # type: ignore[assignment]
        asked = dataclasses.replace(base, compute=compute_dtype or base.compute, reduce=reduce_dtype or base.reduce,
                                    norm_dtype=norm_dtype, norms=norm_predicate(norms))
        self.policy = asked.keeping_fp32(full_precision)
        if full_precision and self.policy is asked:  # never a flag silently ignored
            raise ValueError(
                f"`full_precision={set(full_precision)!r}` keeps modules in fp32 under the mixed flags ('bf16-mixed',"
                f" '16-mixed') with `norm_dtype=torch.float32`; here precision={precision!r},"
                f" norm_dtype={norm_dtype!r}. Drop `full_precision`, or use a mixed flag with fp32 norms.")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.scaler: ShardedGradScaler | None = ShardedGradScaler(self.device) if base.loss_scaling else None
        guard = NonFiniteGuard(max_skipped_steps, check_gradients=self.scaler is None)  # validates it always
        on = precision != "32-true" if skip_nonfinite is None else skip_nonfinite
        self.nonfinite_guard: NonFiniteGuard | None = guard if on else None
        self._library_ops: tuple[AutocastOp, ...] | None = None  # found at the first step (library_ops.py)

    @override
    def convert_module(self, module: _M) -> _M:
        """Master weights in the master dtype (norms keep theirs), cast for compute by FSDP's all-gather, which casts
        no buffer: unsaved floating buffers take the compute dtype, saved ones keep the master dtype and their
        owners compute under autocast (:func:`floating_buffers`, :func:`autocast_around`); parametrizations compute
        in the master dtype (:mod:`.parametrizations`)."""
        keep, policy = {id(m) for _, m in self.policy.separate_norm_modules(module)}, self.policy
        if policy.compute != policy.master:
            refuse_low_precision_statistics(module, keep, policy.compute, policy.master)
            keep |= compute_parametrizations_in(module, policy.master)
        under_autocast = []
        for submodule in (m for m in module.modules() if id(m) not in keep):
            unsaved, saved = floating_buffers(submodule)
            buffers, params = buffer_slots(submodule), list(submodule.parameters(recurse=False))
            for dtype, tensors in ((policy.compute, [buffers[n] for n in unsaved]),
                                   (policy.master, [*params, *(buffers[n] for n in saved)])):
                for tensor in tensors:
                    if tensor.is_floating_point() and dtype != torch.float32:  # (fp32: as the module was built)
                        tensor.data = tensor.data.to(dtype)
            if policy.compute != policy.master and saved:
                under_autocast.append(submodule)
        autocast_around(under_autocast, policy.compute)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """Under the mixed flags the batch keeps its dtypes, as under DDP's AMP: the layers cast what they compute
        with, and targets keep their precision (box coordinates in bf16 are 8 pixels apart past 1024). Under
        ``"bf16-true"`` floating batch tensors take bf16, as Lightning's ``HalfPrecision`` casts them."""
        if self.policy.compute != self.policy.master:
            return data
        return apply_to_collection(data, function=to_dtype(self.policy.compute), dtype=Tensor)

    @override
    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=to_dtype(torch.get_default_dtype()), dtype=Tensor)

    @contextmanager
    @override
    def tensor_init_context(self) -> Iterator[None]:
        yield

    @contextmanager
    @override
    def forward_context(self) -> Iterator[None]:
        """Each step: where DDP's AMP has autocast, the ops that have no bf16 kernel but autocast computes in fp32
        run as under it (torchvision's ``nms`` and ``roi_align``, ``torch.cdist``, a loss mixing bf16 with an fp32
        weight: :mod:`.library_ops`); the rest computes as O2."""
        with self._library_ops_as_under_autocast(), self._step_as_under_amp():
            yield

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule,  # type: ignore[override]
                 optimizer: Steppable | None, *args: Any, **kwargs: Any) -> None:
        with self._library_ops_as_under_autocast():  # checkpointing recomputes blocks in the backward
            super().backward(tensor, model, optimizer, *args, **kwargs)

    def _step_as_under_amp(self) -> AbstractContextManager[None]:
        if self.policy.compute == self.policy.master:
            return nullcontext()
        return step_under_autocast(self.device, self.policy.compute)

    def _library_ops_as_under_autocast(self) -> AbstractContextManager[None]:
        if self.policy.compute == self.policy.master:  # no autocast under DDP's "32-true" and "bf16-true" either
            return nullcontext()
        if self._library_ops is None:
            self._library_ops = found_ops()
        return as_under_autocast(self._library_ops)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):  # it re-evaluates the closure: no guard
            return self._lbfgs_step(optimizer, model, closure, **kwargs)
        guard = self.nonfinite_guard
        if self.scaler is None and guard is None and not steps_locally(cast(torch.optim.Optimizer, optimizer)):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward and self.scaler is not None:
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]  # before clipping, in _after_closure
        after_closure(self, model, optimizer)
        if skipped_backward:
            return closure_result
        torch_optimizer = cast(torch.optim.Optimizer, optimizer)
        with on_local_shards(torch_optimizer) as local:  # the guard then reads plain local gradients
            step = model.trainer.global_step
            if guard is not None and local and self.scaler is None and skips_on_device(torch_optimizer):
                # the fused step takes the decision as found_inf: no host read of it (a device sync) this step
                found = guard.skip_on_device(closure_result, self._grads(optimizer), step, _device_of(torch_optimizer))
                step_output = _step_unless_found(torch_optimizer, found, kwargs)
            elif guard is not None and guard.should_skip(closure_result, self._grads(optimizer), step):
                if self.scaler is not None:
                    self.scaler.update()  # the scale backs off as on an overflow the scaler saw itself
                return closure_result
            elif self.scaler is None:
                step_output = optimizer.step(**kwargs)
            else:
                step_output = self.scaler.step(torch_optimizer, **kwargs)  # skipped on inf/nan
        if self.scaler is not None:
            self.scaler.update()
        return closure_result if step_output is None else step_output  # as `optimizer.step(closure)` returns

    def _lbfgs_step(self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any],
                    **kwargs: Any) -> Any:
        """As DDP's plugins: refused with a gradient scaler (``"16-mixed"``: Lightning's ``MixedPrecision`` says the
        same), stepped with its closure otherwise, on the local tensors where they are whole parameters (one rank;
        several ranks are refused at setup: ``optimizer_probe.refuse_unshardable``)."""
        if self.scaler is not None:
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        lbfgs = cast(torch.optim.LBFGS, optimizer)
        if not holds_whole_parameters(lbfgs):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        with lbfgs_on_whole_locals(lbfgs) as refreshing:
            return super().optimizer_step(optimizer, model=model, closure=refreshing(closure), **kwargs)

    def on_train_end(self) -> None:
        """The strategy's ``on_train_end``: the non-finite flags of the last steps a fused step decided on the device
        are read (and counted, warned about, raised on) before ``fit`` returns."""
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.settle()

    @override
    def teardown(self) -> None:
        """After every fit, also one ended by an exception (Lightning tears down then too): the flags of steps decided
        on the device and not read yet are counted now, not at the next fit's first step as if they were its own."""
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.close()
        super().teardown()

    def _grads(self, optimizer: Optimizable) -> Iterator[Tensor]:  # read only where the guard checks gradients
        return (p.grad for p in self.main_params(optimizer) if p.grad is not None)  # type: ignore[arg-type]

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val > 0 and self.scaler is not None and unscales_in_step(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__name__} unscales gradients inside step(), so they cannot be clipped before it."
                " Use a non-fused optimizer with precision='16-mixed' and gradient clipping."
            )
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of all gradients across shards (Lightning's FSDPStrategy refuses this)."""
        clip_grad_norm(list(self.main_params(optimizer)), float(clip_val))

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    return next(p.device for group in optimizer.param_groups for p in group["params"])


def _step_unless_found(optimizer: torch.optim.Optimizer, found: Tensor, kwargs: dict[str, Any]) -> Any:
    """A fused step that leaves weights and state as they were where ``found`` is nonzero, as ``GradScaler`` runs
    it (the attributes are read by torch's fused ``step`` and removed after it)."""
    optimizer.found_inf, optimizer.grad_scale = found, None  # type: ignore[attr-defined]
    try:
        return optimizer.step(**kwargs)
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]


def to_vitscale_precision(plugin: Precision) -> VitScalePrecision:
    """Translate the plugin Lightning's connector built from ``Trainer(precision=...)`` into ours."""
    if isinstance(plugin, VitScalePrecision):
        return plugin
    flag = str(getattr(plugin, "precision", ""))
    if type(plugin) in _TRANSLATABLE and flag in SUPPORTED_FLAGS:
        return VitScalePrecision(flag, device=getattr(plugin, "device", None))  # type: ignore[arg-type]
    raise TypeError(
        f"VitScaleStrategy cannot use {type(plugin).__name__}(precision={flag!r}). Use Trainer(precision=...) with"
        f" one of {', '.join(SUPPORTED_FLAGS)}, or pass plugins=[VitScalePrecision(...)]."
    )
