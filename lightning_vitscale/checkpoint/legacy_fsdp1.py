"""Deprecated path (the README named it): FSDP1 ``SHARDED_STATE_DICT`` import lives in ``checkpoint/fsdp1/``."""

import warnings

from lightning_vitscale.checkpoint.fsdp1.sharded import MODEL_ENTRIES, convert_fsdp1_checkpoint, load_fsdp1_state_dict

warnings.warn(
    "lightning_vitscale.checkpoint.legacy_fsdp1 is deprecated; import from lightning_vitscale.checkpoint.fsdp1.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["MODEL_ENTRIES", "convert_fsdp1_checkpoint", "load_fsdp1_state_dict"]
