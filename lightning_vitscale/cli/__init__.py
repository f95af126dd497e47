"""Command line: ``python -m lightning_vitscale demo|plan|consolidate|export``, one module per command.

Each module has a ``*_command_parser`` and a ``*_command``; the work lives in the concerns (``checkpoint``,
``memory``) and the strategy. The top layer: nothing in the package imports it.
"""

from __future__ import annotations

import argparse

from lightning_vitscale.cli.consolidate import consolidate_command_parser
from lightning_vitscale.cli.demo import demo_command_parser
from lightning_vitscale.cli.export import export_command_parser
from lightning_vitscale.cli.plan import plan_command_parser


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m lightning_vitscale", description="`python -m lightning_vitscale COMMAND --help`: its options."
    )
    subparsers = top.add_subparsers(dest="name", required=True)
    demo_command_parser(subparsers)
    consolidate_command_parser(subparsers)
    export_command_parser(subparsers)
    plan_command_parser(subparsers)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.command(args))
