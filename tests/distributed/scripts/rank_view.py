"""What a rank process sees of itself (argv, environment, Lightning's rank, ``__main__``), and an exit code 3 on rank
1: the launch helper must give every rank what ``python script.py`` under torchrun would. Rank 1 also leaves a
non-daemon thread running and an ``atexit`` handler, which its exit must wait for and run in that order, as
Python's own exit does (a background checkpoint write is such a thread)."""

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

dist.init_process_group("gloo")
dist.barrier()
view = {
    "argv": sys.argv[1:],
    "file": __file__,
    "name": __name__,
    "lightning_rank": rank_zero_only.rank,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "cwd": os.getcwd(),
    "pid": os.getpid(),
}
Path(sys.argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(view))
dist.barrier()  # both written before rank 1's exit makes torchrun stop rank 0
dist.destroy_process_group()
if view["local_rank"] == 1:
    out = Path(sys.argv[1])

    def late_write() -> None:
        time.sleep(0.5)
        (out / "thread1.txt").write_text("written")

    threading.Thread(target=late_write).start()
    atexit.register(lambda: (out / "atexit1.txt").write_text(f"thread done: {(out / 'thread1.txt').exists()}"))
    sys.exit(3)
