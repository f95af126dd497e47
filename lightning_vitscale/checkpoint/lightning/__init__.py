"""Lightning's side of checkpoints: the strategy's launcher, which resolves ``ckpt_path="last"`` and
``auto_resume`` to the newest complete checkpoint before Lightning does (``launcher.py``), and
:class:`VitScaleCheckpointIO`, which lets DDP and single-device runs resume from a sharded folder (``loaders.py``).
Nothing here changes Lightning: users pass the IO plugin, the strategy configures its launcher.

May import the core checkpoint modules, ``_compat`` and Lightning; the core modules never import this sub-room.
"""

from lightning_vitscale.checkpoint.lightning.launcher import ResumeLauncher, resolve_ckpt_path
from lightning_vitscale.checkpoint.lightning.loaders import (
    VitScaleCheckpointIO,
    is_sharded_checkpoint,
    load_sharded_as_full,
)

__all__ = [
    "ResumeLauncher",
    "VitScaleCheckpointIO",
    "is_sharded_checkpoint",
    "load_sharded_as_full",
    "resolve_ckpt_path",
]
