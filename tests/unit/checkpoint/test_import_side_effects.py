"""Importing lightning_vitscale leaves other strategies' users alone (issue 32 item 6).

The only changes an import makes to Lightning are the ones ``checkpoint/lightning/patches.py`` documents
(``PATCHED_AT_IMPORT``), each a wrapper around Lightning's original; ``auto_resume``'s ``_parse_ckpt_path`` is
wrapped only once a ``VitScaleStrategy`` is created; ``torch.load`` is never touched. A single-device
(``strategy="auto"``, DDP's file format) fit, save, ``ckpt_path="last"`` resume and ``load_from_checkpoint`` give
the same results, bit for bit, in a process that imported the package and in one that did not.

Mutations seen failing: installing ``_parse_ckpt_path``'s wrapper at import (``changed`` gains it); a ``pl_load``
wrapper that handled every folder or file (the round-trip differs, or ``changed`` loses ``__wrapped__``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_vitscale.checkpoint.lightning.patches import PATCHED_AT_IMPORT, PATCHED_BY_STRATEGY

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    r'''
    import hashlib, json, sys
    import torch
    from torch import nn
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch import strategies, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.core import saving
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.trainer.connectors import checkpoint_connector

    OWNERS = {
        "saving": saving, "torch_io": torch_io, "cloud_io": cloud_io, "torch": torch,
        "torch.serialization": torch.serialization, "ModelCheckpoint": ModelCheckpoint,
        "_CheckpointConnector": checkpoint_connector._CheckpointConnector, "Trainer": Trainer,
        "LightningModule": pl.LightningModule, "TorchCheckpointIO": torch_io.TorchCheckpointIO,
        "DDPStrategy": strategies.DDPStrategy, "SingleDeviceStrategy": strategies.SingleDeviceStrategy,
    }

    def snapshot():
        return {f"{owner}.{name}": value for owner, obj in OWNERS.items() for name, value in vars(obj).items()}

    before = snapshot()
    if sys.argv[1] == "with":
        import lightning_vitscale
    after = snapshot()
    changed = sorted(k for k in before if after.get(k) is not before[k])
    wraps_original = all(getattr(after[k], "__wrapped__", None) is before[k] for k in changed)
    if sys.argv[1] == "with":
        lightning_vitscale.VitScaleStrategy()
    by_strategy = sorted(k for k in before if snapshot().get(k) is not after[k])

    class Model(pl.LightningModule):
        def __init__(self, width: int = 8):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    def data():
        g = torch.Generator().manual_seed(0)
        ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=8)

    def trainer(folder, steps):
        return Trainer(
            strategy="auto", accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)],
        )

    def digest(state):
        h = hashlib.sha256()
        for key in sorted(state):
            h.update(key.encode()); h.update(state[key].detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    folder = sys.argv[2]
    torch.manual_seed(0)
    first = trainer(folder, 4)
    first.fit(Model(), data())
    last = first._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False)
    torch.manual_seed(1)
    second = trainer(folder, 8)
    resumed = Model()
    second.fit(resumed, data(), ckpt_path="last")
    loaded = Model.load_from_checkpoint(f"{folder}/last.ckpt")
    raw = torch.load(f"{folder}/last.ckpt", weights_only=True)
    plain = f"{folder}/plain.pt"
    torch.save({"w": torch.arange(6.0), "step": 3}, plain)
    print(json.dumps({
        "changed": changed, "wraps_original": wraps_original, "by_strategy": by_strategy,
        "last": last.rsplit("/", 1)[-1], "resumed": digest(resumed.state_dict()), "loaded": digest(loaded.state_dict()),
        "raw": digest(raw["state_dict"]), "raw_keys": sorted(raw), "step": raw["global_step"],
        "plain": digest({"w": torch.load(plain)["w"]}), "hparams": dict(loaded.hparams),
    }))
    '''
)


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """A fresh interpreter (the zygote's imported the package already: a fork of it could not compare), its
    output in files (two running at once could fill each other's pipes)."""
    folder = tmp_path / mode
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(f"{folder}.out", "w") as out, open(f"{folder}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(folder)], stdout=out, stderr=err, env=env)
    return proc, folder


def finish(proc: subprocess.Popen, folder: Path) -> dict:
    proc.wait(timeout=300)
    assert proc.returncode == 0, Path(f"{folder}.err").read_text()[-3000:]
    return json.loads(Path(f"{folder}.out").read_text().strip().splitlines()[-1])


def name(owner: object, attribute: str) -> str:
    return f"{getattr(owner, '__name__', '').rsplit('.', 1)[-1]}.{attribute}"


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """Both processes at once: each is ~8 s of imports on one core of the 2-core CI machine (17 s one after the
    other, ~9 s together)."""
    tmp = tmp_path_factory.mktemp("import_side_effects")
    started = [start(tmp, "without"), start(tmp, "with")]
    try:
        return finish(*started[0]), finish(*started[1])
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_import_changes_only_the_documented_names_each_around_lightnings_original(both):
    without, with_import = both
    assert without["changed"] == [] and without["by_strategy"] == []
    expected = sorted(name(owner, attribute) for owner, attribute in PATCHED_AT_IMPORT)
    assert with_import["changed"] == expected
    assert with_import["wraps_original"]  # each is a wrapper whose __wrapped__ is Lightning's own function
    assert "_CheckpointConnector._parse_ckpt_path" not in with_import["changed"]  # only once a strategy exists
    assert with_import["by_strategy"] == sorted(name(owner, attribute) for owner, attribute in PATCHED_BY_STRATEGY)
    assert not any(key.startswith(("torch.", "Trainer.", "DDPStrategy.")) for key in with_import["changed"])


def test_a_single_device_run_saves_resumes_and_loads_as_without_the_import(both):
    without, with_import = both
    for key in ("last", "resumed", "loaded", "raw", "raw_keys", "step", "plain", "hparams"):
        assert with_import[key] == without[key], key
    assert with_import["last"] == "last.ckpt" and with_import["loaded"] == with_import["raw"]
