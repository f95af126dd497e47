"""The one device table: the planner's rates, the MFU report's peak and the plan CLI's named memories read it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from lightning_vitscale._utils import GIB
from lightning_vitscale.cli.plan import plan_command_parser
from lightning_vitscale.memory import devices
from lightning_vitscale.memory.budget import parse_memory
from lightning_vitscale.memory.devices import DEVICES, Device, device_named, gpu_named
from lightning_vitscale.memory.step_cost import GPU_RATES, rates_for
from lightning_vitscale.monitoring.throughput import device_peak_flops

CUDA = torch.device("cuda")
# What torch.cuda.get_device_name() says on each GPU -> the row it must find.
CUDA_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-80gb",
    "NVIDIA H100 PCIe": "h100-pcie-80gb",
    "NVIDIA H100 NVL": "h100-nvl-94gb",
    "NVIDIA H200": "h200-141gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "Tesla V100-SXM2-32GB": "v100-32gb",
    "NVIDIA L40S": "l40s-48gb",
    "NVIDIA L40": "l40-48gb",
    "NVIDIA L4": "l4-24gb",
    "NVIDIA A10G": "a10g-24gb",
    "NVIDIA A10": "a10-24gb",
}


def _on_gpu(monkeypatch: pytest.MonkeyPatch, cuda_name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: cuda_name)


def _plan_help() -> str:
    subparsers = argparse.ArgumentParser().add_subparsers()
    plan_command_parser(subparsers)
    return subparsers.choices["plan"].format_help()


def _agree(row: Device, monkeypatch: pytest.MonkeyPatch, cuda_name: str) -> None:
    """The three consumers read ``row``: the planner's rates, MFU's peak, the plan CLI's memory."""
    _on_gpu(monkeypatch, cuda_name)
    rates = rates_for(CUDA)
    assert (rates.flops_per_s, rates.bytes_per_s, rates.link_bytes_per_s, rates.latency_s, rates.unit_s) == (
        row.reached_flops_per_s, row.hbm_bytes_per_s, row.link_bytes_per_s, row.latency_s, row.unit_s)
    assert rates.regather_hidden and rates.overlaps
    assert device_peak_flops(CUDA) == row.bf16_flops_per_s
    assert parse_memory(row.name) == row.memory_bytes
    assert row.name in " ".join(_plan_help().split())


@pytest.mark.parametrize("cuda_name", sorted(CUDA_NAMES))
def test_every_gpu_row_is_what_the_planner_mfu_and_cli_read(cuda_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    row = gpu_named(cuda_name)
    assert row is not None and row.name == CUDA_NAMES[cuda_name]
    _agree(row, monkeypatch, cuda_name)


def test_a_changed_row_changes_every_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that kept its own number would not follow a row the table changes."""
    h100 = device_named("h100-80gb")
    changed = dataclasses.replace(h100, memory_bytes=7 * GIB, bf16_flops_per_s=123e12, reached_flops_per_s=45e12,
                                  hbm_bytes_per_s=1.1e12, link_bytes_per_s=33e9, latency_s=7e-5, unit_s=2.5e-3)
    table = tuple(changed if row is h100 else row for row in DEVICES)
    monkeypatch.setattr(devices, "DEVICES", table)
    monkeypatch.setattr(devices, "_BY_NAME", {row.name: row for row in table})
    _agree(changed, monkeypatch, "NVIDIA H100 80GB HBM3")


def test_cpu_unknown_gpu_and_sources() -> None:
    cpu = device_named("cpu")
    assert rates_for("cpu").flops_per_s == cpu.reached_flops_per_s
    assert not rates_for("cpu").regather_hidden and device_peak_flops(torch.device("cpu")) is None
    assert rates_for(None) == GPU_RATES and GPU_RATES.flops_per_s == device_named("h200-141gb").reached_flops_per_s
    assert gpu_named("Some Future GPU") is None
    for row in DEVICES:
        assert row.source.startswith(("datasheet", "measured: ")), row
    assert device_named("h200-141gb").source.startswith("measured: ")  # issue 31's H200 run
    with pytest.raises(ValueError, match="h100-80gb"):
        device_named("h900")
