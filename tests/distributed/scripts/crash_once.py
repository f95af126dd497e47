"""Rank 1 dies of a native crash (``abort()``, as gloo's does on a collective mismatch): on the first launch only
(``OUT MARKER``: it creates MARKER first), or on every launch (``OUT always``). Each rank that lives writes
``OUT/rank<R>.json``."""

import os
import sys
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
out, marker = Path(sys.argv[1]), sys.argv[2]
if dist.get_rank() == 1 and (marker == "always" or not os.path.exists(marker)):
    if marker != "always":
        Path(marker).touch()
    os.abort()
out.joinpath(f"rank{dist.get_rank()}.json").write_text("{}")
dist.barrier()
dist.destroy_process_group()
