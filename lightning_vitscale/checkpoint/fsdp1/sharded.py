"""FSDP1-era sharded checkpoints (``SHARDED_STATE_DICT`` saved with ``torch.distributed.checkpoint``) as one plain
``torch.save`` file that ``strategy="ddp"``, a plain module or ``VitScaleStrategy`` loads.

The safe reader puts FSDP1's ``ShardedTensor`` chunks back at their offsets in one process (no process group, no
FSDP1 import); what is left is finding the model's entry in what the user saved and dropping wrapper prefixes.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_vitscale._utils import strip_wrapper_prefixes
from lightning_vitscale.checkpoint.consolidate import require_file_target, write_file
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.formats import PathLike, as_full, require_existing
from lightning_vitscale.checkpoint.safe_reading import load_all, read_metadata
from lightning_vitscale.checkpoint.storage import DCP_METADATA, Location

# Where FSDP1-era scripts put the model's state dict inside the saved dict (torch's DCP tutorial: "model";
# Lightning's FSDPStrategy: "model"; scripts reusing Lightning's layout: "state_dict").
MODEL_ENTRIES = ("model", "state_dict", "module")


def load_fsdp1_state_dict(
    src: PathLike, dtype: torch.dtype | None = None, weights_only: bool | None = None
) -> dict[str, torch.Tensor]:
    """An FSDP1 ``SHARDED_STATE_DICT`` folder's model as plain keys and whole CPU tensors (``dtype=None``: saved)."""
    source = Location.of(src)
    require_existing(source)
    if not source.is_dir() or DCP_METADATA not in source.names():
        raise CheckpointError(
            f"{source} is not an FSDP1 SHARDED_STATE_DICT folder (no {DCP_METADATA}). Pass the folder that"
            " torch.distributed.checkpoint.save wrote; a FULL_STATE_DICT file needs no conversion (torch.load it)."
        )
    read_metadata(source, weights_only)  # readable, every shard present: a clear error before any value is read
    model = _model_entry(load_all(source, weights_only), source)
    return {strip_wrapper_prefixes(key): as_full(value, dtype) for key, value in model.items()}


def convert_fsdp1_checkpoint(
    src: PathLike, dst: PathLike, dtype: torch.dtype | None = torch.float32, weights_only: bool | None = None
) -> PathLike:
    """Write ``{"state_dict": ...}`` of :func:`load_fsdp1_state_dict` to ``dst``: weights to start a run from,
    not a ``ckpt_path`` to resume (no optimizer or loop state: Lightning refuses it, nothing resumes half-fresh)."""
    require_file_target(dst)
    return write_file({"state_dict": load_fsdp1_state_dict(src, dtype=dtype, weights_only=weights_only)}, dst)


def _model_entry(state: dict[str, Any], location: Location) -> dict[str, Any]:
    """The model's tensors: the whole dict when it holds only tensors, else its ``model``-like entry."""
    for entry in (state, *(state.get(name) for name in MODEL_ENTRIES)):
        if isinstance(entry, dict) and entry and all(torch.is_tensor(v) for v in entry.values()):
            return entry
    raise CheckpointError(
        f"{location} holds no model state dict where FSDP1 scripts put it: its top-level entries are"
        f" {sorted(state)[:8]}, and none of {list(MODEL_ENTRIES)} is a dict of tensors. Save the model's"
        " SHARDED_STATE_DICT as dcp.save(model.state_dict()) or dcp.save({'model': model.state_dict(), ...})."
    )
