"""The public surface users and the docs rely on: top-level names, the registered strategy name, the commands and
the module paths the README and CHANGELOG name. Moving code between modules must not change any of it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_vitscale
from lightning_vitscale.cli import parser

PUBLIC_NAMES = {
    "AsyncSaveError",
    "BackwardOutsideManualBackwardError",
    "CheckpointError",
    "InStepCallError",
    "KernelPolicy",
    "MemoryPlan",
    "MixedTensorsError",
    "NoBlocksMatchedError",
    "NonFiniteTrainingError",
    "OutsideStepCallError",
    "ParameterWriteError",
    "SecondBackwardError",
    "SetupSummary",
    "ShardedEMA",
    "ShardedModuleReuseError",
    "SkippedBlocksError",
    "StateBytes",
    "StateDictGatherError",
    "VitScaleCheckpointIO",
    "VitScalePrecision",
    "VitScaleStrategy",
    "VitScaleThroughput",
    "consolidate_checkpoint",
    "consolidated",
    "find_blocks",
    "grad_norm",
    "measure_state_bytes",
    "plan_memory",
}

# module path -> names the README / CHANGELOG tell users to import from it
DOCUMENTED_PATHS = {
    "lightning_vitscale.checkpoint": {
        "consolidate_checkpoint", "consolidated", "load_consolidated", "CheckpointError", "AsyncSaveError", "verify",
    },
    "lightning_vitscale.strategy": {"VitScaleStrategy"},
    "lightning_vitscale.checkpoint.fsdp1": {
        "convert_fsdp1_checkpoint", "load_fsdp1_state_dict", "load_fsdp1_local_state_dict",
    },
    "lightning_vitscale.checkpoint.export": {"read_weights", "WeightsChoice"},  # examples/models/finetune.py
    "lightning_vitscale.__main__": {"main"},
}


def test_top_level_names_are_pinned():
    assert set(lightning_vitscale.__all__) == PUBLIC_NAMES
    for name in PUBLIC_NAMES:
        assert getattr(lightning_vitscale, name) is not None
    assert lightning_vitscale.__version__ == "0.1.0"


@pytest.mark.parametrize("module", sorted(DOCUMENTED_PATHS))
def test_documented_module_paths_keep_working(module):
    imported = importlib.import_module(module)
    missing = {name for name in DOCUMENTED_PATHS[module] if not hasattr(imported, name)}
    assert not missing


def test_documented_names_are_the_same_objects_everywhere():
    from lightning_vitscale.checkpoint import consolidate_checkpoint
    from lightning_vitscale.kernels import KernelPolicy

    assert consolidate_checkpoint is lightning_vitscale.consolidate_checkpoint
    assert KernelPolicy is lightning_vitscale.KernelPolicy


def test_strategy_is_registered_under_its_name():
    assert "vitscale" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("vitscale"), lightning_vitscale.VitScaleStrategy)


def test_commands_are_unchanged():
    commands = parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == {"demo", "plan", "consolidate", "export"}
    consolidate = parser().parse_args(["consolidate", "a", "b", "--weights", "ema", "--unsafe", "--keep-dtype"])
    assert (consolidate.src, consolidate.dst, consolidate.weights, consolidate.unsafe) == ("a", "b", "ema", True)
    demo = parser().parse_args(["demo", "--steps", "3", "--precision", "bf16-mixed"])
    assert (demo.steps, demo.precision) == (3, "bf16-mixed")
    plan = parser().parse_args(["plan", "--memory", "a100-40gb", "--batch-size", "8"])
    assert (plan.memory, plan.batch_size) == ("a100-40gb", 8)


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_vitscale", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert all(command in out.stdout for command in ("demo", "plan", "consolidate"))


def test_strategy_settings_stay_readable():
    strategy = lightning_vitscale.VitScaleStrategy(state_dict_type="full", init="meta")
    assert strategy.state_dict_type == "full" and strategy.plan is None
    assert strategy.config.sharding.layout == "full" and strategy.config.kernels == "auto"
    strategy.state_dict_type = "sharded"  # assigning is validated like the constructor argument
    with pytest.raises(ValueError, match="'sharded'.*'full'"):
        strategy.state_dict_type = "fsdp"  # type: ignore[assignment]
