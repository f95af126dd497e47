"""Weight parametrizations (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``, ``orthogonal``, a
user's own) computed in the master dtype under the mixed flags, as DDP's AMP computes them from its fp32 weights.

O2 gathers a unit's parameters in bf16, a parametrization's originals among them, so the weight a layer uses was
computed from them in bf16 (a norm over a row in bf16; ``orthogonal``'s matrix exponential or Householder product in
bf16), and ``spectral_norm``'s power iteration met its fp32 vectors (saved buffers) with a bf16 weight and raised
("addmv input tensors must have the same dtype"). Here each parametrization takes its inputs in
the master dtype (the gathered originals, upcast: what the unit holds is bf16, the arithmetic on it is fp32), and the
weight it makes goes to the layer in the dtype the unit gathered, so the layer itself computes as O2. The modules
inside a parametrization keep their buffers as built (no compute-dtype cast, no autocast around an owner).

The old hook-based ``torch.nn.utils.weight_norm`` (DINO's and DINOv2's heads) has no such module: its weight is
computed by the layer's own pre-hook from ``weight_g`` and ``weight_v``, in the compute dtype, as any O2 weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from lightning_vitscale.precision.casting import to_dtype


def compute_parametrizations_in(model: nn.Module, dtype: torch.dtype) -> set[int]:
    """Make every parametrization of ``model`` compute in ``dtype``; returns the ids of the modules inside them (the
    lists and what they hold), which the plugin's casts leave alone."""
    inside: set[int] = set()
    for listed in (m for m in model.modules() if isinstance(m, ParametrizationList)):
        for parametrization in listed.children():
            parametrization.register_forward_pre_hook(_inputs_in(dtype))
        listed.register_forward_hook(_output_as_gathered)
        inside.update(id(m) for m in listed.modules())
    return inside


def _inputs_in(dtype: torch.dtype) -> Any:
    cast = to_dtype(dtype)

    def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(cast(arg) for arg in args)

    return hook


def _output_as_gathered(listed: nn.Module, _: tuple[Any, ...], output: Any) -> Any:
    """The weight in the dtype of the originals it was made from (the unit's gathered dtype: bf16 under O2)."""
    gathered = next((p.dtype for p in listed.parameters(recurse=False) if p.is_floating_point()), None)
    return to_dtype(gathered)(output)
