"""The DINO example's teacher before and after a short fit, in one process through the example's CLI and the
module's own Lightning loop: ``python tests/examples/scripts/pretraining_learns.py <CLI args>`` prints
``{"untrained": k-NN accuracy, "trained": k-NN accuracy}`` as its last line."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

from examples import pretraining


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    # Its share of the cores (forked from the test zygote: 1 thread before): every core alone, one of two beside
    # another pytest-xdist worker's ranks, whose one thread each 2 spinning OpenMP threads slowed 8x (32 -> 252 s).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    cli = pretraining.main(argv, run=False)
    cli.trainer.validate(cli.model, cli.datamodule, verbose=False)  # the teacher as built: untrained
    untrained = float(cli.trainer.callback_metrics["knn_acc"])
    cli.trainer.fit(cli.model, cli.datamodule)
    trained = float(cli.trainer.callback_metrics["knn_acc"])
    print(json.dumps({"untrained": untrained, "trained": trained}))


if __name__ == "__main__":
    main(sys.argv[1:])
