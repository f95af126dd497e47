"""What a rank started by Lightning's own launcher (or by torchrun, which Fabric then defers to) sees of itself:
argv, ``__main__``, its local rank, its parent and ``sys.executable``; with ``sleep``, every rank then sleeps
(a launch's timeout must end them all). ``python lightning_rank_view.py OUT (return|sleep)``."""

import json
import os
import sys
import time
from pathlib import Path

from lightning.fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
view = {
    "argv": sys.argv[1:],
    "file": __file__,
    "name": __name__,
    "local_rank": fabric.local_rank,
    "pid": os.getpid(),
    "parent": os.getppid(),
}
Path(sys.argv[1], f"rank{fabric.global_rank}.json").write_text(json.dumps(view))
fabric.barrier()
if sys.argv[2] == "sleep":
    time.sleep(120)
