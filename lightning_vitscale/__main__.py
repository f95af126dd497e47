"""Command line: `python -m lightning_vitscale demo` and `python -m lightning_vitscale consolidate SRC DST`."""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_vitscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small ViT with DDP and with VitScaleStrategy and compare")
    demo.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    demo.add_argument("--devices", type=int, default=None, help="processes (default: all GPUs, or 2 on CPU)")
    demo.add_argument("--steps", type=int, default=10)
    demo.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from lightning_vitscale.demo import run_demo

        table = run_demo(args.accelerator, args.devices, args.steps, args.precision)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
            print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
