"""VitScalePrecision: the Lightning precision plugin that owns the dtype policy (which dtype where)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_utilities import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_vitscale._compat import MixedPrecisionPolicy
from lightning_vitscale.clipping import clip_grad_norm

PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true"]
SUPPORTED_FLAGS: tuple[str, ...] = get_args(PrecisionFlag)
# Lightning's generic plugins that only carry a flag; anything more specific is the user's choice to keep.
_TRANSLATABLE: tuple[type[Precision], ...] = (Precision, MixedPrecision, HalfPrecision)


@dataclass(frozen=True)
class DtypePolicy:
    """Resolved dtypes of one precision flag.

    Attributes:
        master: dtype of the sharded parameters the optimizer updates (and of its state).
        compute: dtype blocks compute in (parameters are all-gathered in it).
        reduce: dtype gradients are reduced in across ranks.
    """

    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype

    @property
    def is_low_precision(self) -> bool:
        return self.compute != torch.float32


def resolve_flag(flag: str) -> DtypePolicy:
    """One place that turns a precision string into dtypes; anything unknown is an error naming the choices."""
    match flag:
        case "32-true":
            return DtypePolicy(torch.float32, torch.float32, torch.float32)
        case "bf16-mixed":
            # O2: bf16 compute, fp32 master weights and optimizer state, fp32 gradient reduction.
            return DtypePolicy(torch.float32, torch.bfloat16, torch.float32)
        case "bf16-true":
            return DtypePolicy(torch.bfloat16, torch.bfloat16, torch.bfloat16)
        case _:
            raise ValueError(
                f"VitScaleStrategy does not support precision={flag!r}. Choose one of: {', '.join(SUPPORTED_FLAGS)}."
            )


class VitScalePrecision(Precision):
    """BF16 "O2" for sharded models: low-precision compute on fp32 master weights, set per FSDP unit.

    Args:
        precision: the Trainer-style flag, see :data:`SUPPORTED_FLAGS`.
        compute_dtype: override the dtype blocks compute in.
        reduce_dtype: override the dtype gradients are reduced in.

    Example::

        Trainer(strategy=VitScaleStrategy(), plugins=[VitScalePrecision("bf16-mixed", reduce_dtype=torch.bfloat16)])
    """

    def __init__(
        self,
        precision: PrecisionFlag = "32-true",
        *,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        base = resolve_flag(precision)
        self.precision = precision  # type: ignore[assignment]
        self.dtypes = DtypePolicy(
            master=base.master,
            compute=compute_dtype or base.compute,
            reduce=reduce_dtype or base.reduce,
        )

    def mp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2 policy for every unit: gather in the compute dtype, reduce in the reduce dtype."""
        if not self.dtypes.is_low_precision and self.dtypes.reduce == self.dtypes.master:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtypes.compute, reduce_dtype=self.dtypes.reduce)

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Master weights in the master dtype; the compute casts happen inside FSDP's all-gather."""
        return module.to(dtype=self.dtypes.master) if self.dtypes.master != torch.float32 else module

    @override
    def convert_input(self, data: Any) -> Any:
        """Floating batch tensors enter in the compute dtype; integer targets are left alone."""
        return _cast_floating(data, self.dtypes.compute)

    @override
    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())

    @contextmanager
    @override
    def tensor_init_context(self) -> Iterator[None]:
        yield

    @override
    def clip_grad_by_norm(self, optimizer: Optimizable, clip_val: int | float) -> None:
        """Clip by the norm of all gradients across shards (Lightning's FSDPStrategy refuses this)."""
        clip_grad_norm(list(self.main_params(optimizer)), float(clip_val))


def to_vitscale_precision(plugin: Precision) -> VitScalePrecision:
    """Translate the plugin Lightning's connector built from ``Trainer(precision=...)`` into ours."""
    if isinstance(plugin, VitScalePrecision):
        return plugin
    flag = str(getattr(plugin, "precision", ""))
    if type(plugin) in _TRANSLATABLE and flag in SUPPORTED_FLAGS:
        return VitScalePrecision(flag)  # type: ignore[arg-type]
    raise TypeError(
        f"VitScaleStrategy cannot use {type(plugin).__name__}(precision={flag!r}). Use Trainer(precision=...) with"
        f" one of {', '.join(SUPPORTED_FLAGS)}, or pass plugins=[VitScalePrecision(...)]."
    )


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    return apply_to_collection(data, function=cast, dtype=Tensor)
