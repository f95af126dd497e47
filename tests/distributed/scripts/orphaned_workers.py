"""A rank killed while its data loader workers are busy (a slow decode): its peers must not wait for them.

``python orphaned_workers.py STRATEGY OUT``: Lightning's own launcher starts rank 1; rank 0 sends itself SIGKILL
as step 2 begins (an out-of-memory kill, a node's preemption), while its two loader workers are inside a
``__getitem__`` that takes minutes. Forked after the process group was made, the workers hold copies of rank 0's
sockets: until they exit, rank 1 sees no peer gone and waits in the step's collective. Each process writes its
pid and start time (``/proc`` ticks) to ``OUT/pids/`` so the test can tell when each ended.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lightning_vitscale import VitScaleStrategy
from tests.helpers.launch import record_identity
from tests.helpers.models import CLASSES, IMAGE, Classifier

warnings.filterwarnings("ignore")
SLOW_AFTER = 8  # items a worker loads at once (its first two batches of 4: steps 0-3); each later one takes minutes
SLOW_S = 300.0


class SlowLater(Dataset):
    def __init__(self) -> None:
        self.loaded = 0  # in this worker (each has its own copy)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += get_worker_info() is not None  # the strategy reads a planning batch in the rank itself
        if self.loaded > SLOW_AFTER:
            time.sleep(SLOW_S)  # busy in user code: the worker's own parent check does not run meanwhile
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, IMAGE, IMAGE, generator=generator), torch.randint(0, CLASSES, (), generator=generator)


class KilledAtStep2(Classifier):
    def __init__(self, out: Path) -> None:
        super().__init__("encoder")
        self.out = out

    def on_fit_start(self) -> None:
        record_identity(self.out / "pids" / f"rank{self.global_rank}")

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.global_rank == 0 and batch_idx == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    (out / "pids").mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    loader = DataLoader(
        SlowLater(), batch_size=4, num_workers=2,
        worker_init_fn=lambda worker: record_identity(out / "pids" / f"worker-rank{rank}-{worker}"),
    )  # fmt: skip
    strategy = VitScaleStrategy(timeout=timedelta(seconds=600)) if name == "vitscale" else name
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(KilledAtStep2(out), loader)


if __name__ == "__main__":
    main()
