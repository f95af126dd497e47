"""`python -m lightning_vitscale plan`: build a LightningModule on the meta device from an import path or a
LightningCLI config and print its memory plan. Only argument handling lives here; the planning is memory/planner.py."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from lightning_vitscale.memory import MemoryPlan, plan_memory
from lightning_vitscale.memory.budget import DEFAULT_FRACTION
from lightning_vitscale.memory.cluster import forecast_table
from lightning_vitscale.memory.devices import device_named, memory_names
from lightning_vitscale.memory.step_inputs import OPTIMIZER_STATES
from lightning_vitscale.precision import SUPPORTED_FLAGS

# Data-module arguments the example CLIs link into the model (LightningCLI `link_arguments`).
_LINKED = ("img_size", "in_chans", "num_classes")


def plan_command_parser(subparsers: Any) -> None:
    plan = subparsers.add_parser("plan", help="predict per-rank memory of a training step and recommend settings")
    plan.add_argument("--config", help="LightningCLI YAML (model/data/trainer sections), e.g. examples/configs/*.yaml")
    plan.add_argument("--model", help="LightningModule or nn.Module import path 'pkg.module:Class'"
                                      " (default: the config's model.class_path)")
    plan.add_argument("--init-args", nargs="*", default=[], metavar="KEY=VALUE",
                      help="model init arguments (values parsed as JSON when they can be), or one JSON object")
    plan.add_argument("--input-shape", help="one sample's shape, e.g. 3,224,224 (default: example_input_array,"
                                            " else in_chans,img_size,img_size from the config)")
    plan.add_argument("--batch-size", type=int, help="per-rank batch (default: the config's data batch_size)")
    plan.add_argument("--devices", type=int, help="devices per node (default: the config's, else 1)")
    plan.add_argument("--nodes", type=int, help="nodes (default: the config's num_nodes, else 1)")
    plan.add_argument("--memory", default="a100-80gb",
                      help=f"device memory in GiB or a named GPU ({', '.join(memory_names())}); a named GPU also"
                      " gets the predicted images/s of DDP + AMP O1, the plan and the recipe")
    plan.add_argument("--cluster", metavar="[NODESx]DEVICESxGPU",
                      help="a named cluster, e.g. 8xa100-40gb or 16x8xa100-80gb: sets --nodes, --devices and --memory")
    plan.add_argument("--precision", choices=SUPPORTED_FLAGS, help="default: the config's, else bf16-mixed")
    plan.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    plan.add_argument("--memory-fraction", type=float, default=DEFAULT_FRACTION,
                      help="share of device memory a step may use")
    plan.add_argument("--tensor-parallel", type=int, default=1, metavar="K",
                      help="VitScaleStrategy(tensor_parallel=K): each block split over K ranks (of devices x nodes);"
                      " the batch is one data-parallel rank's")
    plan.set_defaults(command=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    plan = run_plan(args)
    print(plan.summary())
    if args.memory in memory_names():
        print("\n" + forecast_table(plan, device_named(args.memory)))
    return 0


def run_plan(args: argparse.Namespace) -> MemoryPlan:
    if args.cluster:
        args.nodes, args.devices, args.memory = _cluster(args.cluster)
    config = (yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else {}
    trainer, data = config.get("trainer", {}) or {}, _init_args(config.get("data"))
    model_cfg = config.get("model", {}) or {}
    target = args.model or (model_cfg.get("class_path") if isinstance(model_cfg, dict) else None)
    if not target:
        raise SystemExit("error: name the model with --model pkg.module:Class (the config has no model.class_path).")
    cls = _import(target)
    kwargs = {**_init_args(model_cfg), **_parse_init_args(args.init_args)}
    kwargs = {**_linked_from_data(cls, config.get("data"), data, kwargs), **kwargs}
    with torch.device("meta"):
        module = cls(**kwargs)
        if hasattr(module, "configure_model"):
            module.configure_model()
    batch = args.batch_size or data.get("batch_size")
    example = _example_input(module, args.input_shape, kwargs, batch)
    devices = args.devices or _int(trainer.get("devices"), 1)
    nodes = args.nodes or _int(trainer.get("num_nodes"), 1)
    precision = args.precision or trainer.get("precision") or "bf16-mixed"
    return plan_memory(module, example, batch_size=batch, world_size=devices * nodes, device_memory=args.memory,
                       precision=str(precision), optimizer=args.optimizer, memory_fraction=args.memory_fraction,
                       tensor_parallel=args.tensor_parallel)


def _cluster(spec: str) -> tuple[int, int, str]:
    """``"8xa100-40gb"`` -> (1 node, 8 devices, ``"a100-40gb"``); ``"16x8xa100-80gb"`` -> 16 nodes of 8."""
    match = re.fullmatch(r"(?:(\d+)x)?(\d+)x(.+)", spec.strip().lower())
    if match is None or match.group(3) not in memory_names():
        raise SystemExit(f"error: --cluster takes [NODESx]DEVICESxGPU, e.g. 8xa100-40gb, with a GPU of"
                         f" {', '.join(memory_names())}; got {spec!r}.")
    return int(match.group(1) or 1), int(match.group(2)), match.group(3)


def _init_args(section: Any) -> dict[str, Any]:
    if not isinstance(section, dict):
        return {}
    return dict(section.get("init_args") or {}) if "class_path" in section else dict(section)


def _import(target: str) -> type:
    module_name, _, attr = target.partition(":") if ":" in target else target.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `examples.models...` and the user's own package from a checkout
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise SystemExit(f"error: cannot import {target!r} ({error}); give it as 'pkg.module:Class'.") from error


def _parse_init_args(items: list[str]) -> dict[str, Any]:
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        return json.loads(items[0])
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --init-args takes KEY=VALUE pairs; got {item!r}.")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def _linked_from_data(cls: type, section: Any, data: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """What the examples' CLI links from the data module: its init args, else its class attributes."""
    accepted = inspect.signature(cls).parameters
    data_cls = None
    if isinstance(section, dict) and "class_path" in section:
        with contextlib.suppress(SystemExit):
            data_cls = _import(section["class_path"])
    wanted = [name for name in _LINKED if name not in given and name in accepted]
    values = {name: data.get(name, getattr(data_cls, name, None)) for name in wanted}
    return {name: value for name, value in values.items() if isinstance(value, int)}


def _example_input(module: nn.Module, shape: str | None, kwargs: dict[str, Any], batch: int | None) -> Any:
    if shape:
        dims = tuple(int(d) for d in shape.split(","))
        return torch.empty(batch or 1, *dims, device="meta")
    example = getattr(module, "example_input_array", None)
    if isinstance(example, torch.Tensor) and batch and example.shape[0] != batch:
        return torch.empty(batch, *example.shape[1:], device="meta")
    if example is not None:
        return example
    if "img_size" in kwargs:
        chans = kwargs.get("in_chans", 3)
        return torch.empty(batch or 1, chans, kwargs["img_size"], kwargs["img_size"], device="meta")
    raise SystemExit("error: no input shape: pass --input-shape C,H,W or set example_input_array on the module.")


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default
