"""What a rank process sees of itself (argv, environment, Lightning's rank, ``__main__``), and an exit code 3 on rank
1: the launch helper must give every rank what ``python script.py`` under torchrun would."""

import json
import os
import sys
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
    sys.exit(3)
