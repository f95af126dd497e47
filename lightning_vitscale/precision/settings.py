"""Which dtype where: the precision flags the plugin accepts, their dtype policy, and which modules are norms."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from lightning_vitscale.discovery import find_modules, is_normalization

PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
SUPPORTED_FLAGS: tuple[str, ...] = get_args(PrecisionFlag)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype where: ``master`` (the sharded parameters and optimizer state), ``compute`` (units gather their
    parameters in it), ``reduce`` (gradients across ranks), ``norm_dtype`` (normalization layers; ``None``: as the
    rest); ``norms``: which modules those are; ``loss_scaling``: fp16's dynamic loss scaler."""

    name: str
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    norm_dtype: torch.dtype | None = torch.float32
    norms: Callable[[str, nn.Module], bool] | None = is_normalization
    loss_scaling: bool = False

    @property
    def separate_norms(self) -> bool:
        """Norms need their own handling only where they would otherwise get another dtype."""
        return self.norm_dtype is not None and self.norms is not None and (
            self.compute != self.norm_dtype or self.master != self.norm_dtype
        )

    def keeping_fp32(self, names: Collection[str]) -> PrecisionPolicy:
        """This policy with the modules ``names`` (qualified in the model) kept in ``norm_dtype`` beside the norms:
        those a step runs inside its own ``torch.autocast(..., enabled=False)`` (a head computed in fp32 on purpose),
        which DDP's AMP computes in fp32 and O2 alone would compute in ``compute``. Mixed flags only: under
        ``"bf16-true"`` the master weights are bf16 as DDP's are."""
        norms, kept = self.norms or _no_module, frozenset(names)
        if not kept or self.norm_dtype is None or self.master != torch.float32 or self.compute == self.norm_dtype:
            return self
        def inside(name: str) -> bool:  # the module or one holding it: a block named keeps its layers
            return any(name == k or name.startswith(f"{k}.") for k in kept)

        return dataclasses.replace(self, norms=lambda name, module: norms(name, module) or inside(name))

    def separate_norm_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(name, module) of the norms kept apart in ``norm_dtype``; none where they need no handling of their own."""
        if not self.separate_norms or self.norms is None:
            return []
        return find_modules(model, self.norms)


def resolve_flag(flag: str) -> PrecisionPolicy:
    """One place that turns a precision string into dtypes; anything unknown is an error naming the choices."""
    match flag:
        case "32-true":
            return PrecisionPolicy(flag, torch.float32, torch.float32, torch.float32)
        case "bf16-mixed":
            # O2: bf16 compute, fp32 master weights and optimizer state, fp32 gradient reduction.
            return PrecisionPolicy(flag, torch.float32, torch.bfloat16, torch.float32)
        case "bf16-true":
            return PrecisionPolicy(flag, torch.bfloat16, torch.bfloat16, torch.bfloat16)
        case "16-mixed":
            return PrecisionPolicy(flag, torch.float32, torch.float16, torch.float32, loss_scaling=True)
        case _:
            raise ValueError(
                f"VitScaleStrategy does not support precision={flag!r}. Choose one of: {', '.join(SUPPORTED_FLAGS)}."
            )


NormSelector = bool | set[type[nn.Module]] | Callable[[str, nn.Module], bool] | None
"""``None``/``True``: detect normalization layers; ``False``: none; a set of classes; or a predicate."""


def _no_module(name: str, module: nn.Module) -> bool:
    return False


def norm_predicate(norms: NormSelector) -> Callable[[str, nn.Module], bool] | None:
    """Turn ``VitScalePrecision(norms=...)`` into a predicate on (name, module); ``None``: no norm is special."""
    match norms:
        case None | True:
            return is_normalization
        case False:
            return None
        case set() | frozenset():
            classes = tuple(norms)
            return lambda _, module: isinstance(module, classes)
        case _ if callable(norms):
            return norms
        case _:
            raise TypeError(f"`norms` must be None, True, False, a set of classes or a callable; got {norms!r}.")
