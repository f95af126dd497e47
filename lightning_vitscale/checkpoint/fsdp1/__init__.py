"""Importing FSDP1 / FairScale-era checkpoints into DDP's plain state dict: ``SHARDED_STATE_DICT`` folders
(``sharded.py``) and per-rank ``LOCAL_STATE_DICT`` files (``local.py``, ``flat_layout.py``,
``sharded_tensor_pickle.py``).

May import the core checkpoint modules and ``_compat``; the core never imports this sub-room.
"""

from lightning_vitscale.checkpoint.fsdp1.local import (
    build_model,
    convert_fsdp1_local_checkpoint,
    load_fsdp1_local_state_dict,
)
from lightning_vitscale.checkpoint.fsdp1.sharded import convert_fsdp1_checkpoint, load_fsdp1_state_dict

__all__ = [
    "build_model",
    "convert_fsdp1_checkpoint",
    "convert_fsdp1_local_checkpoint",
    "load_fsdp1_local_state_dict",
    "load_fsdp1_state_dict",
]
