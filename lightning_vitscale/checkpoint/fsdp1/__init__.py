"""Importing FSDP1 / FairScale-era checkpoints: ``SHARDED_STATE_DICT`` folders (``sharded.py``) and per-rank
``LOCAL_STATE_DICT`` files (``local.py``, with FSDP1's flat-parameter layout in ``flat_layout.py`` and the inert
reading of pickled ``ShardedTensor`` s in ``sharded_tensor_pickle.py``), into DDP's plain state dict.

May import the core checkpoint modules (the safe reader, formats, consolidation's writer) and ``_compat``; the
core modules never import this sub-room.
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
