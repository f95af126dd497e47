"""`python -m lightning_vitscale consolidate SRC DST`: a sharded checkpoint folder as one ``torch.save`` file, every
file of SRC first checked against the size and CRC-32 its save recorded (``--no-verify``: not); ``consolidate SRC``
(no DST): only that check.

Argument handling only; the conversion is ``checkpoint/consolidate.py``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from lightning_vitscale.checkpoint import CheckpointError, Location, consolidate_checkpoint, verify
from lightning_vitscale.checkpoint.fsdp1 import build_model, convert_fsdp1_checkpoint, convert_fsdp1_local_checkpoint


def consolidate_command_parser(subparsers: Any) -> None:
    export = subparsers.add_parser(
        "consolidate", help="sharded checkpoint folder -> one torch.save file (plain module)"
    )
    export.add_argument("src", help="checkpoint folder written by VitScaleStrategy")
    export.add_argument("dst", nargs="?", help="output file, e.g. model.ckpt (none: only check SRC)")
    export.add_argument(
        "--verify", action=argparse.BooleanOptionalAction, default=None,
        help="check every file of SRC against the size and CRC-32 its save recorded, before writing DST (default for"
        " --from vitscale); --no-verify: only to read a damaged folder anyway",
    )
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
    export.add_argument(
        "--from", dest="source_format", choices=["vitscale", "fsdp1", "fsdp1-local"], default="vitscale",
        help="vitscale: a folder VitScaleStrategy saved; fsdp1: a torch FSDP1 SHARDED_STATE_DICT folder (dcp.save);"
        " fsdp1-local: FSDP1 LOCAL_STATE_DICT rank files (a folder or a pattern like 'run/model.rank_*.pth'),"
        " needs --model",
    )
    export.add_argument(
        "--model", metavar="MODULE:CALLABLE",
        help="with --from fsdp1-local: `package.module:callable` building the model FSDP1 wrapped (it is imported"
        " and called with no arguments, on the meta device): the names and shapes the files lack",
    )
    export.set_defaults(command=consolidate_command)


def consolidate_command(args: argparse.Namespace) -> int:
    checks = args.verify if args.verify is not None else args.source_format == "vitscale"
    if args.dst is None and not checks:
        print("error: give DST (the output file); without DST, consolidate only verifies SRC", file=sys.stderr)
        return 2
    try:
        if checks and args.source_format != "vitscale":
            raise CheckpointError("--verify applies to --from vitscale: FSDP1 saves recorded no CRC-32s.")
        if args.dst is None:
            verify(Location.of(args.src))
            print(f"verified {args.src}: every file matches its size and CRC-32")
            return 0
        out = _convert(args, checks)
    except (CheckpointError, OSError) as error:  # bad SRC or DST: the message names the path and the fix
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _convert(args: argparse.Namespace, checks: bool) -> Any:
    """SRC -> DST through the converter of SRC's format (``--from``)."""
    dtype = None if args.keep_dtype else torch.float32
    weights_only = False if args.unsafe else None
    if args.source_format != "fsdp1-local" and args.model is not None:
        raise CheckpointError("--model applies to --from fsdp1-local only: the other formats name their tensors.")
    if args.source_format.startswith("fsdp1") and args.weights != "raw":
        raise CheckpointError("--weights ema applies to VitScaleStrategy folders only; FSDP1 saved no EMA.")
    if args.source_format == "fsdp1":
        return convert_fsdp1_checkpoint(args.src, args.dst, dtype=dtype, weights_only=weights_only)
    if args.source_format == "fsdp1-local":
        if args.model is None:
            raise CheckpointError(
                "--from fsdp1-local needs --model package.module:callable: LOCAL_STATE_DICT files hold flat"
                " parameters without their names and shapes, which come from the model definition."
            )
        model = build_model(args.model)
        return convert_fsdp1_local_checkpoint(args.src, args.dst, model, dtype=dtype, weights_only=weights_only)
    return consolidate_checkpoint(
        args.src, args.dst, dtype=dtype, weights_only=weights_only, weights=args.weights, verify=checks
    )
