"""Every shipped config parses against its script's LightningCLI (typos / stale keys fail here, not on a cluster)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.helpers.launch import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

CONFIGS = sorted((REPO_ROOT / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_parses(config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    task = config.stem.split("_")[0]
    script = importlib.import_module(f"examples.{task}")
    monkeypatch.setattr("sys.argv", [f"examples/{task}.py"])
    with pytest.raises(SystemExit) as exc:
        script.main(["fit", "--config", str(config), "--print_config"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    # By name, or the class with its options (the tensor-parallel config: they are parsed against its signature).
    assert "strategy: vitscale" in printed or "class_path: lightning_vitscale.VitScaleStrategy" in printed
