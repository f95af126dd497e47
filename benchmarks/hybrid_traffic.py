"""Bytes each rank sends per training step inside its node and across nodes: full vs hybrid sharding.

Every layout runs a few real training steps of ``lightning_vitscale.cli.demo.TinyViT`` (fp32) on CPU ranks grouped
into "nodes" on this machine (``torchrun --nnodes N --node-rank i`` per node, each its own process tree), and
counts the collectives really issued (``torch.distributed`` functions wrapped; each call counted as a ring
over its process group, a group holding ranks of two nodes counted as across-node). The strategy's own plan
(``trainer.strategy.plan.layout``) is printed beside it.

    python benchmarks/hybrid_traffic.py                        # 2x2 and 2x4 ranks, two model sizes
    python benchmarks/hybrid_traffic.py --layouts 2x2 4x2 --sizes small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {"small": {"dim": 128, "depth": 4}, "medium": {"dim": 384, "depth": 8}}


def worker(out: Path, sizes: list[str], per_node: int, nodes: int) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_vitscale import VitScaleStrategy
    from lightning_vitscale.cli.demo import TinyViT
    from tests.helpers.recording import TrafficRecorder

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.last: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self._ctx = TrafficRecorder(per_node).recording()
            self._recorder = self._ctx.__enter__()

        def on_train_batch_end(self, *args) -> None:
            self._ctx.__exit__(None, None, None)
            self.last = [self._recorder.intra, self._recorder.inter]

    rows = []
    for size in sizes:
        for sharding in ("full", "hybrid"):
            L.seed_everything(0, verbose=False)
            model, probe = TinyViT(**SIZES[size]), Probe()
            n = 3 * per_node * nodes * 2
            data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
            trainer = L.Trainer(
                accelerator="cpu", devices=per_node, num_nodes=nodes, strategy=VitScaleStrategy(sharding=sharding),
                max_steps=3, callbacks=[probe], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )
            trainer.fit(model, DataLoader(data, batch_size=2))
            layout = trainer.strategy.plan.layout
            rows.append({
                "size": size, "params": sum(p.numel() for p in model.parameters()), "sharding": sharding,
                "layout": layout.sharding, "measured": probe.last,
                "planned": [layout.traffic.intra_node, layout.traffic.inter_node],
            })
    if dist.get_rank() == 0:
        (out / f"{nodes}x{per_node}.json").write_text(json.dumps(rows))


def launch(nodes: int, per_node: int, sizes: list[str], out: Path) -> None:
    from tests.helpers.launch import assert_ok, multinode_launch

    args = ["--worker", "--out", str(out), "--sizes", *sizes, "--layouts", f"{nodes}x{per_node}"]
    for result in multinode_launch(__file__, *args, nodes=nodes, per_node=per_node, timeout=900):
        assert_ok(result)


def table(out: Path, layouts: list[str]) -> str:
    lines = [
        "| model | params | nodes x ranks | sharding | intra-node MiB/step/rank | across-node MiB/step/rank"
        " | plan: intra / across MiB | across vs full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout in layouts:
        rows = json.loads((out / f"{layout}.json").read_text())
        full_inter = {r["size"]: r["measured"][1] for r in rows if r["sharding"] == "full"}
        for r in rows:
            intra, inter = (b / 2**20 for b in r["measured"])
            plan = " / ".join(f"{b / 2**20:.3f}" for b in r["planned"])
            ratio = r["measured"][1] / full_inter[r["size"]]
            lines.append(
                f"| {r['size']} | {r['params']:,} | {layout} | {r['layout']} | {intra:.3f} | {inter:.3f} | {plan}"
                f" | {ratio:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["2x2", "2x4"], help="NODESxRANKS_PER_NODE")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=sorted(SIZES))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "hybrid_traffic"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        nodes, per_node = (int(x) for x in args.layouts[0].split("x"))
        worker(out, args.sizes, per_node, nodes)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for layout in args.layouts:
        nodes, per_node = (int(x) for x in layout.split("x"))
        launch(nodes, per_node, args.sizes, out)
    print(table(out, args.layouts))


if __name__ == "__main__":
    main()
