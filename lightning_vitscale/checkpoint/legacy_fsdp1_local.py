"""Deprecated path (the README named it): FSDP1 ``LOCAL_STATE_DICT`` import lives in ``checkpoint/fsdp1/``."""

import warnings

from lightning_vitscale.checkpoint.fsdp1.local import (
    build_model,
    convert_fsdp1_local_checkpoint,
    load_fsdp1_local_state_dict,
)

warnings.warn(
    "lightning_vitscale.checkpoint.legacy_fsdp1_local is deprecated; import from lightning_vitscale.checkpoint.fsdp1.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["build_model", "convert_fsdp1_local_checkpoint", "load_fsdp1_local_state_dict"]
