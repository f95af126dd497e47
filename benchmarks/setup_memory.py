"""Host memory each rank needs to set up a model built in ``configure_model()``, for both init paths, on CPU.

Usage (each run is launched with torch's elastic launcher and killed after ``--timeout`` seconds)::

    python benchmarks/setup_memory.py                            # 0.5 / 1 / 2.4 GB x 1 / 2 / 4 ranks x exact / meta
    python benchmarks/setup_memory.py --sizes 2.4 --ranks 4      # a subset; rows are appended to setup_memory.json

The model: blocks of ``Linear(2048, 2048) + GELU`` (16.8 MB each, fp32) with a ``self.apply`` truncated-normal
init, built in ``configure_model()``; ``VitScaleStrategy(init="exact" | "meta")``, ``precision="32-true"``.
Per rank, peak growth = ``VmHWM`` read in ``on_train_start`` minus ``VmRSS`` read in the ``setup`` hook, after
resetting VmHWM there (``/proc/self/clear_refs`` = 5), so it covers ``configure_model()`` and all sharding;
divided by the full model's bytes. Setup seconds: ``setup`` hook to ``on_train_start``. Then one SGD step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.ports import free_port  # noqa: E402 - after the checkout is importable

WIDTH = 2048
BLOCK_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _net(depth: int):  # type: ignore[no-untyped-def]
    """The model class, made where the worker runs (the driver imports neither torch nor Lightning)."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(depth)])
            self.apply(self._init)

        @staticmethod
        def _init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)

    return Net


def _module(net):  # type: ignore[no-untyped-def]
    """The LightningModule: builds ``net`` in configure_model and measures setup from its own hooks."""
    import lightning as L
    import torch
    from torch import nn

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module | None = None

        def setup(self, stage: str) -> None:
            Path("/proc/self/clear_refs").write_text("5")
            self.rss_before, self.t0 = _status_bytes("VmRSS"), time.perf_counter()

        def configure_model(self) -> None:
            if self.net is None:
                self.net = net()

        def on_train_start(self) -> None:
            self.seconds = time.perf_counter() - self.t0
            self.growth = _status_bytes("VmHWM") - self.rss_before

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Module


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    from lightning_vitscale import VitScaleStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    Module = _module(_net(max(1, round(args.gb * 1e9 / BLOCK_BYTES))))
    model = Module()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=VitScaleStrategy(init=args.path),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=2)
    trainer.fit(model, data)
    params = list(model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    local = sum(p.to_local().numel() * p.element_size() for p in params)
    plan = trainer.strategy.plan
    out = dict(
        rank=trainer.global_rank, gb=args.gb, path=plan.init_path, ranks=trainer.world_size, full=full, local=local,
        growth=model.growth, seconds=model.seconds, sampled_peak=plan.init_peak_bytes, steps=trainer.global_step,
    )
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def run(gb: float, ranks: int, path: str, timeout: float) -> list[dict]:
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        # A fixed mmap threshold: glibc otherwise raises it after each large free, so the gathered parameters of
        # every block in the training step stay in its heap (~3x the model per rank at 1 GB, OOM at 2.4 GB x 4).
        env = dict(
            os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT),
            MALLOC_MMAP_THRESHOLD_=str(2**20),
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(Path(__file__).resolve()), "--worker", "--gb", str(gb),
            "--path", path, "--out", out,
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{gb} GB, {ranks} ranks, {path}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return sorted((json.loads(f.read_text()) for f in Path(out).glob("rank*.json")), key=lambda r: r["rank"])


def table(rows: list[dict]) -> str:
    lines = [
        "| model GB | init | ranks | rank 0 growth / model | max other rank growth / model | kept / model (local"
        " shards) | setup s (max rank) | rank 0 sampled peak / model (strategy's summary) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group in rows:
        r0, others = group[0], group[1:]
        other = f"{max(r['growth'] for r in others) / r0['full']:.2f}" if others else "-"
        lines.append(
            f"| {r0['full'] / 1e9:.2f} | {r0['path']} | {r0['ranks']} | {r0['growth'] / r0['full']:.2f} | {other} |"
            f" {max(r['local'] for r in group) / r0['full']:.2f} | {max(r['seconds'] for r in group):.1f} |"
            f" {r0['sampled_peak'] / r0['full']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], target: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, who in zip(axes, ("rank 0", "largest other rank")):
        for key in sorted({(g[0]["gb"], g[0]["path"]) for g in rows}):
            points = sorted(
                (g[0]["ranks"], (g[0] if who == "rank 0" else max(g[1:], key=lambda r: r["growth"]))["growth"]
                 / g[0]["full"])
                for g in rows if (g[0]["gb"], g[0]["path"]) == key and (who == "rank 0" or len(g) > 1)
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{key[0]} GB, {key[1]}")
        ax.set_title(f"{who}: peak host memory growth in setup")
        ax.set_xlabel("ranks")
        ax.set_xticks([1, 2, 4])
    axes[0].set_ylabel("growth / full model")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    return f"plot: {target.name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--path", default="exact")
    parser.add_argument("--out", default=".")
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1.0, 2.4])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--paths", nargs="+", default=["exact", "meta"])
    parser.add_argument("--timeout", type=float, default=170)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    store = HERE / "setup_memory.json"
    rows = json.loads(store.read_text()) if store.exists() else []
    for gb in args.sizes:
        for ranks in args.ranks:
            for path in args.paths:
                group = run(gb, ranks, path, args.timeout)
                rows = [g for g in rows if (g[0]["gb"], g[0]["ranks"], g[0]["path"]) != (gb, ranks, path)]
                rows.append(group)
                print(table([group]).splitlines()[-1], flush=True)
    rows.sort(key=lambda g: (g[0]["gb"], g[0]["path"], g[0]["ranks"]))
    store.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(plot(rows, HERE / "setup_memory.png"))


if __name__ == "__main__":
    main()
