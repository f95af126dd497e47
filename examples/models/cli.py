"""The one LightningCLI launcher every example uses: default strategy "vitscale", CPU-friendly logging.

Kept here so the three scripts share defaults instead of copy-pasting them.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from jsonargparse import lazy_instance
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger

import lightning_vitscale  # noqa: F401  -- importing registers strategy="vitscale" with Lightning
from examples.models.loading import DataWaitTimer
from lightning_vitscale import VitScaleThroughput


class ExampleCLI(LightningCLI):
    """LightningCLI that defaults ``--data`` and links the datamodule's shape facts into the model.

    Linking (classes, channels, image size, ...) means a user switching datamodules never has to
    keep the model's head/stem in sync by hand.
    """

    default_data: type[pl.LightningDataModule]
    links: tuple[str, ...] = ()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data": lazy_instance(self.default_data)})
        for name in self.links:
            parser.link_arguments(f"data.{name}", f"model.{name}", apply_on="instantiate")


def run_cli(
    model_class: type[pl.LightningModule],
    default_data: type[pl.LightningDataModule],
    task: str,
    links: tuple[str, ...],
    max_epochs: int,
    args: ArgsType = None,
    run: bool = True,
) -> LightningCLI:
    """Start the CLI for one example; any LightningDataModule can replace the default via ``--data``."""
    cli_class: Any = type(f"{task.capitalize()}CLI", (ExampleCLI,), {"default_data": default_data, "links": links})
    return cli_class(
        model_class,
        pl.LightningDataModule,
        subclass_mode_data=True,
        seed_everything_default=0,
        trainer_defaults={
            "strategy": "vitscale",
            "max_epochs": max_epochs,
            "log_every_n_steps": 5,
            "precision": "32-true",  # bf16 on CPU is slow; the GPU configs switch to bf16-mixed
            "logger": lazy_instance(CSVLogger, save_dir="lightning_logs", name=task),
            # samples/s, TFLOP/s, MFU (against the GPU's peak dense bf16) and peak memory per rank
            # + data-wait vs step time per step: shows when the loader, not the model, is the bottleneck
            "callbacks": [lazy_instance(VitScaleThroughput, log_every_n_steps=10), lazy_instance(DataWaitTimer)],
        },
        args=args,
        run=run,
    )
