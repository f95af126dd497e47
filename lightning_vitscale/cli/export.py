"""`python -m lightning_vitscale export SRC DST --format safetensors|hf|timm|torchvision`: one submodule's weights
(trained, EMA or DINO teacher) out of a checkpoint, in the format people publish and load.

Argument handling only; the reading and the formats are ``checkpoint/export/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lightning_vitscale.checkpoint import CheckpointError
from lightning_vitscale.checkpoint.export import (
    EXPORT_DTYPES,
    build_submodule,
    parse_arch_args,
    read_weights,
    write_hf,
    write_safetensors,
    write_timm,
    write_torchvision,
)
from lightning_vitscale.checkpoint.storage import Location


def export_command_parser(subparsers: Any) -> None:
    export = subparsers.add_parser(
        "export", help="a checkpoint's (sub)module weights -> safetensors, an HF folder, timm, torchvision"
    )
    export.add_argument("src", help="a sharded checkpoint folder, a .ckpt file or a state-dict file")
    export.add_argument("dst", help="output: a file (safetensors, torchvision) or a folder (hf, timm)")
    export.add_argument("--format", default="safetensors", choices=["safetensors", "hf", "timm", "torchvision"])
    export.add_argument(
        "--module", default="",
        help="the submodule to export, e.g. net or backbone: its prefix is stripped from the names (default: all)",
    )
    export.add_argument(
        "--weights", default="model", choices=["model", "ema", "teacher"],
        help="model: the trained weights; ema: the ShardedEMA average; teacher: the DINO example's EMA teacher"
        " (--module is then looked up inside it)",
    )
    export.add_argument("--dtype", default="fp32", choices=sorted(EXPORT_DTYPES), help="floating tensors' dtype")
    export.add_argument(
        "--model", metavar="PKG.MODULE:CLASS",
        help="--format hf: the LightningModule that trained the run, built on the meta device from the checkpoint's"
        " hyper-parameters to get the submodule's config (default: the `_class_path` LightningCLI saved)",
    )
    export.add_argument("--arch", help="--format timm/torchvision: the architecture's name in that library")
    export.add_argument("--arch-args", help="--format timm/torchvision: its keyword arguments as a JSON object")
    export.add_argument(
        "--unsafe", action="store_true",
        help="load every pickle in SRC with weights_only=False (runs any code it holds): only for trusted files",
    )
    export.add_argument(
        "--no-verify", dest="verify", action="store_false",
        help="skip checking SRC's files against the CRC-32s its save recorded: only to read a damaged folder anyway",
    )
    export.set_defaults(command=export_command)


def export_command(args: argparse.Namespace) -> int:
    try:
        out = run_export(args)
    except (CheckpointError, OSError, ValueError) as error:  # the message names the cause and the fix
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def run_export(args: argparse.Namespace) -> Location:
    """Check the options that do not fit the format first, then read once and write."""
    if args.format in ("timm", "torchvision") and not args.arch:
        raise CheckpointError(
            f"--format {args.format} needs --arch (the {args.format} architecture these weights are, e.g. --arch"
            f" {'vit_small_patch16_224' if args.format == 'timm' else 'resnet18'}) and, for other sizes, --arch-args."
        )
    if args.format not in ("timm", "torchvision") and (args.arch or args.arch_args):
        raise CheckpointError("--arch and --arch-args apply to --format timm and torchvision only.")
    if args.model and args.format != "hf":
        raise CheckpointError("--model applies to --format hf only (the other formats need no module instance).")
    dtype = EXPORT_DTYPES[args.dtype]
    weights = read_weights(
        args.src, weights=args.weights, module=args.module, dtype=dtype, weights_only=False if args.unsafe else None,
        verify=args.verify,
    )
    match args.format:
        case "safetensors":
            return write_safetensors(weights, args.dst)
        case "hf":
            class_path = args.model or weights.hyper_parameters.get("_class_path")
            if not class_path:
                raise CheckpointError(
                    f"--format hf needs the LightningModule class to build the submodule's config: pass --model"
                    f" package.module:Class (the class that trained {args.src}; its saved hyper-parameters are used)."
                )
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # `examples.models...` and the user's own package from a checkout
            submodule = build_submodule(class_path, weights.hyper_parameters, args.module, args.weights)
            return write_hf(weights, args.dst, submodule, dtype)
        case "timm":
            return write_timm(weights, args.dst, args.arch, parse_arch_args(args.arch_args))
        case "torchvision":
            return write_torchvision(weights, args.dst, args.arch, parse_arch_args(args.arch_args))
        case _:
            raise ValueError(f"unknown --format {args.format!r}")
