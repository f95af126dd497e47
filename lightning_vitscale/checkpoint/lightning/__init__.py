"""Lightning's side of checkpoints: the strategy's launcher, resolving ``ckpt_path="last"`` and ``auto_resume``
(``launcher.py``), and :class:`VitScaleCheckpointIO`, letting DDP runs resume from a sharded folder
(``loaders.py``). Nothing here changes Lightning: users pass the IO plugin, the strategy configures its launcher.

May import the core checkpoint modules, ``_compat`` and Lightning; the core never imports this sub-room.
"""

from lightning_vitscale.checkpoint.lightning.launcher import ResumeLauncher
from lightning_vitscale.checkpoint.lightning.loaders import VitScaleCheckpointIO

__all__ = ["ResumeLauncher", "VitScaleCheckpointIO"]
