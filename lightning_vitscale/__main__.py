"""Command line: `python -m lightning_vitscale demo`, `... consolidate SRC DST [--weights raw|ema] [--unsafe]`
and `... plan` (memory planner)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lightning_vitscale.plan_cli import add_plan_parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_vitscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small ViT with DDP and with VitScaleStrategy and compare")
    demo.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    demo.add_argument("--devices", type=int, default=None, help="processes (default: all GPUs, or 2 on CPU)")
    demo.add_argument("--steps", type=int, default=10)
    demo.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    export = sub.add_parser("consolidate", help="sharded checkpoint folder -> one torch.save file (plain module)")
    export.add_argument("src", help="checkpoint folder written by VitScaleStrategy")
    export.add_argument("dst", help="output file, e.g. model.ckpt")
    export.add_argument("--keep-dtype", action="store_true", help="keep saved dtypes instead of full fp32")
    export.add_argument(
        "--unsafe",
        action="store_true",
        help="load every pickle in SRC with weights_only=False (runs any code it holds): only for trusted files",
    )
    export.add_argument(
        "--weights", choices=["raw", "ema"], default="raw",
        help="raw: the trained weights (+ optimizer, EMA: resumable); ema: the ShardedEMA average, for inference",
    )
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "consolidate":
        from lightning_vitscale.checkpoint import CheckpointError, consolidate_checkpoint

        try:
            dtype = None if args.keep_dtype else torch.float32
            weights_only = False if args.unsafe else None
            out = consolidate_checkpoint(
                args.src, args.dst, dtype=dtype, weights_only=weights_only, weights=args.weights
            )
        except (CheckpointError, FileNotFoundError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(f"wrote {out}")
        return 0
    if args.command == "plan":
        from lightning_vitscale.plan_cli import run_plan

        print(run_plan(args).summary())
        return 0
    if args.command == "demo":
        from lightning_vitscale.demo import run_demo

        table = run_demo(args.accelerator, args.devices, args.steps, args.precision)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
            print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
