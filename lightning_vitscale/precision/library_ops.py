"""Ops that fail on O2's bf16 where DDP's AMP runs them in fp32 (torchvision's ``nms``, a DETR matcher's ``cdist``),
run as under autocast.

DDP's AMP runs each step under autocast, which computes some ops in fp32: other libraries' ops with an autocast
kernel of their own (torchvision's ``nms`` and ``roi_align``, whose host kernels have no bf16; CUDA's not checked
here), and torch's ops on autocast's fp32 list. O2 runs no autocast: a detector's region proposals reach ``nms`` in
bf16 and its first step fails (``"nms_kernel" not implemented for 'BFloat16'``), a DETR-style loss's Hungarian
matcher fails in ``torch.cdist``, and its class weight (fp32) meets bf16 logits in ``cross_entropy``.

The step's own code runs under autocast already (:mod:`.step_autocast`); the model's layers do not. Inside
:func:`as_under_autocast` (the plugin's steps, and its backwards, where checkpointing recomputes; the planner's run of
a step) each such op called outside autocast (inside a layer, a block's recompute) with a bf16 or fp16 input runs
inside ``torch.autocast`` for that input's device and dtype, so it computes as under DDP's AMP. Torch's ops that
compute in bf16 inside the layers (softmax, norms) are not among them: O2 computes those in bf16 on purpose; only
those with no bf16 kernel (:data:`TORCH_FUNCTIONS`) and losses (:data:`LOSSES`: a model computing its loss in its
forward, as HF's ``labels=`` does) are. An op autocast leaves alone (torchvision's ``roi_pool`` on the host)
runs as DDP's AMP runs it: as it is.

Callers look such an op up at each call (``torch.ops.torchvision.nms``, ``torch.cdist``, ``F.cross_entropy``): for
the body, that attribute is swapped for :class:`_UnderAutocast` (a few attribute writes per step) and put back.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lightning_vitscale._compat import ops_with_autocast_kernels

LOW_PRECISION = (torch.bfloat16, torch.float16)  # the dtypes torch.autocast computes in
EVERY_DEVICE = frozenset({"cpu", "cuda", "xpu"})

# Torch's functions on autocast's fp32 list with no bf16 kernel on the host (checked on CPU; CUDA's not): run on a
# model's bf16 outputs in a step (a matcher's box distances) or inside a block (a global filter's FFT).
TORCH_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("cdist", "pdist"),
    "torch.nn.functional": ("pdist", "multi_margin_loss", "multilabel_margin_loss"),
    "torch.fft": ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2", "rfftn",
                  "irfftn", "hfft", "ihfft"),
}
# Losses on autocast's fp32 list: in fp32 wherever a bf16 input reaches one, as DDP's AMP computes it: inside a
# model's forward (HF's ``labels=``), where the step's own autocast is off; a call mixing bf16 with an fp32 class weight
# (HF DETR's loss) would fail there ("expected scalar type BFloat16 but found Float").
LOSSES: dict[str, tuple[str, ...]] = {
    "torch.nn.functional": ("cross_entropy", "nll_loss", "binary_cross_entropy_with_logits", "kl_div", "mse_loss",
                            "l1_loss", "smooth_l1_loss", "poisson_nll_loss", "cosine_embedding_loss",
                            "hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
                            "multilabel_soft_margin_loss"),
}


@dataclass(frozen=True)
class AutocastOp:
    """``owner.name`` (a ``torch.ops`` namespace, or a module such as ``torch.fft``), run under autocast on
    ``devices``."""

    owner: Any
    name: str
    devices: frozenset[str]


class _UnderAutocast:
    """``function`` called under autocast where DDP's AMP would have had it: a low-precision input, its device among
    ``devices``, no autocast on already (a library's autocast kernel calls its op again, with autocast on)."""

    def __init__(self, function: Any, devices: frozenset[str]) -> None:
        self.function, self.devices = function, devices

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with autocast_as_amp_would([*args, *kwargs.values()], self.devices, mixed_only=False):
            return self.function(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # an op's overloads (`.default`), schema and name: the packet's
        return getattr(self.function, name)


def autocast_as_amp_would(values: list[Any], devices: frozenset[str] = EVERY_DEVICE,
                           mixed_only: bool = True) -> AbstractContextManager[Any]:
    """``torch.autocast`` for a call on ``values`` where DDP's AMP would have had it: a low-precision floating
    tensor among them, on one of ``devices``, no autocast on already; ``mixed_only``: and a floating tensor of
    another dtype beside it. Else nothing."""
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    low = next((v for v in tensors if v.dtype in LOW_PRECISION), None)
    if low is None or low.device.type not in devices or torch.is_autocast_enabled(low.device.type) or (
            mixed_only and all(v.dtype == low.dtype for v in tensors)):
        return nullcontext()
    return torch.autocast(low.device.type, dtype=low.dtype)


def found_ops() -> tuple[AutocastOp, ...]:
    """Other libraries' ops with an autocast kernel, now, and torch's functions of :data:`TORCH_FUNCTIONS` and
    :data:`LOSSES` (a few milliseconds: once per fit)."""
    library = [AutocastOp(getattr(torch.ops, namespace), name, devices)
               for (namespace, name), devices in ops_with_autocast_kernels().items()]
    own = [AutocastOp(importlib.import_module(module), name, EVERY_DEVICE)
           for table in (TORCH_FUNCTIONS, LOSSES) for module, names in table.items() for name in names]
    return (*library, *own)


@contextmanager
def as_under_autocast(ops: tuple[AutocastOp, ...]) -> Iterator[None]:
    """Within the body each of ``ops`` runs as under DDP's AMP (see the module docstring). A nested body leaves the
    outer one's callers in place."""
    swapped: list[tuple[Any, str, Any]] = []
    for op in ops:
        function = getattr(op.owner, op.name)
        if not isinstance(function, _UnderAutocast):
            setattr(op.owner, op.name, _UnderAutocast(function, op.devices))
            swapped.append((op.owner, op.name, function))
    try:
        yield
    finally:
        for owner, name, function in reversed(swapped):
            setattr(owner, name, function)
