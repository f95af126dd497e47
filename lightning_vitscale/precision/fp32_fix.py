"""The fix noted under torch's error where a layer's own code raised on its low-precision weights under O2.

Setup keeps such a layer in fp32 itself where it runs the step on a batch first (``memory/low_precision_failures.py``:
GFNet's ``torch.view_as_complex`` of its weight, AFNO's einsum of an fp32 spectrum with its weights). Where it could
not (a stream it cannot read ahead), the first step raises torch's words alone ("view_as_complex is only supported
for half, float and double tensors, but got ... BFloat16"), which say nothing of O2: the module and the fix are noted.
"""

from __future__ import annotations

from types import TracebackType

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_vitscale.discovery import parameter_holder
from lightning_vitscale.precision.settings import PrecisionPolicy

_NAMES = {torch.bfloat16: ("bfloat16",), torch.float16: ("half", "float16")}


def names_dtype(error: BaseException, dtype: torch.dtype) -> bool:
    """Whether torch's message names ``dtype`` ("... but got ... BFloat16", "float != c10::BFloat16", "Half")."""
    return any(word in str(error).lower() for word in _NAMES.get(dtype, ()))


def note_fp32_fix(error: BaseException, model: nn.Module | None, policy: PrecisionPolicy, flag: str) -> None:
    """Under the mixed flags, an error naming the compute dtype raised inside a module of ``model`` that holds
    parameters: the fix (``VitScalePrecision(flag, full_precision={name})``) as a note on it."""
    if model is None or policy.compute == policy.master or not names_dtype(error, policy.compute):
        return
    name = _innermost_layer(error.__traceback__, model)
    if not name:
        return
    fix = (f"VitScaleStrategy: under precision={flag!r} (O2) `{name}` computes with its weights in"
           f" {str(policy.compute)[6:]}, where DDP's AMP keeps them in fp32, and its own code raised on them. Keep it"
           f" in fp32: `Trainer(..., plugins=[VitScalePrecision({flag!r}, full_precision={{{name!r}}})])`. Setup"
           f" does so itself where it runs a training step on a batch first (a train dataloader it can read ahead,"
           f" or `example_input_array`).")
    add_note = getattr(error, "add_note", None)
    if fix in getattr(error, "__notes__", ()):
        return
    if add_note is not None:
        add_note(fix)
    else:
        rank_zero_warn(fix)


def _innermost_layer(traceback: TracebackType | None, model: nn.Module) -> str:
    """The innermost module of ``model`` whose code was running where the error was raised, or the closest one above
    it holding parameters; ``""``: none (or the model itself)."""
    names = {id(module): name for name, module in model.named_modules()}
    innermost = ""
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and names.get(id(owner)):
            innermost = names[id(owner)]
        traceback = traceback.tb_next
    return parameter_holder(model, innermost)
