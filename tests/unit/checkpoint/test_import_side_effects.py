"""Importing lightning_vitscale changes nothing of Lightning or torch (issue 50 item 1), and neither does creating the
strategy or a Trainer with it: the strategy reaches Lightning's checkpoint path only through its own launcher and
hooks, and DDP runs read sharded folders only through the IO plugin a user passes.

In a fresh interpreter that imported the package, created ``VitScaleStrategy(auto_resume=True)`` and a Trainer with
it, a ``strategy="ddp"`` fit with a ModelCheckpoint (its folder holding a sub-folder), a resume with
``ckpt_path="last"`` and ``load_from_checkpoint`` give the results of an interpreter that never imported it, bit
for bit, and every attribute of the Lightning and torch objects these paths go through is still the very object it
was before the import (Lightning's own functions, not wrappers; torch submodules imported on the way aside). The one
addition is Lightning's public strategy registry entry ``"vitscale"``.

Mutations seen failing: ``ModelCheckpoint._find_last_checkpoints`` wrapped at import (``changed`` lists it);
``_CheckpointConnector._parse_ckpt_path`` wrapped when the strategy is created (``changed`` lists it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.launch import free_port, rank_env

SCRIPT = textwrap.dedent(
    r'''
    import hashlib, json, os, sys, types
    import torch
    from torch import nn
    import lightning.pytorch as pl
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch import strategies, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.core import saving
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.trainer.connectors import checkpoint_connector
    from lightning.pytorch.strategies.launchers import subprocess_script

    OWNERS = {
        "saving": saving, "torch_io": torch_io, "cloud_io": cloud_io, "torch": torch,
        "torch.serialization": torch.serialization, "ModelCheckpoint": ModelCheckpoint,
        "_CheckpointConnector": checkpoint_connector._CheckpointConnector, "Trainer": Trainer,
        "LightningModule": pl.LightningModule, "TorchCheckpointIO": torch_io.TorchCheckpointIO,
        "DDPStrategy": strategies.DDPStrategy, "ModelParallelStrategy": strategies.ModelParallelStrategy,
        "SingleDeviceStrategy": strategies.SingleDeviceStrategy,
        "_SubprocessScriptLauncher": subprocess_script._SubprocessScriptLauncher,
    }

    def snapshot():
        return {f"{owner}.{name}": value for owner, obj in OWNERS.items() for name, value in vars(obj).items()}

    before, registry = snapshot(), set(StrategyRegistry)
    if sys.argv[1] == "with":
        import lightning_vitscale
        Trainer(strategy=lightning_vitscale.VitScaleStrategy(auto_resume=True), accelerator="cpu", devices=1,
                logger=False)

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
            strategy="ddp", accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
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
    os.makedirs(f"{folder}/sub")  # a sub-folder: what made the package's old patch take "last" over
    last = first._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False)
    torch.manual_seed(1)
    second = trainer(folder, 8)
    resumed = Model()
    second.fit(resumed, data(), ckpt_path="last")
    loaded = Model.load_from_checkpoint(f"{folder}/last.ckpt")
    raw = torch.load(f"{folder}/last.ckpt", weights_only=True)
    after = snapshot()
    added = {k for k in after.keys() - before.keys() if isinstance(after[k], types.ModuleType)}  # torch.numa & co.
    print(json.dumps({
        "changed": sorted(k for k in before.keys() | after.keys() - added if after.get(k) is not before.get(k)),
        "registered": sorted(set(StrategyRegistry) - registry), "last": last.rsplit("/", 1)[-1],
        "resumed": digest(resumed.state_dict()), "loaded": digest(loaded.state_dict()),
        "raw": digest(raw["state_dict"]), "raw_keys": sorted(raw), "step": raw["global_step"],
        "hparams": dict(loaded.hparams),
    }))
    '''
)


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """A fresh interpreter (the zygote's imported the package already: a fork of it could not compare), its
    output in files (two running at once could fill each other's pipes)."""
    folder = tmp_path / mode
    env = rank_env(MASTER_PORT=str(free_port()))  # each its own DDP port: both run at once, after in-process fits
    with open(f"{folder}.out", "w") as out, open(f"{folder}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(folder)], stdout=out, stderr=err, env=env)
    return proc, folder


def finish(proc: subprocess.Popen, folder: Path) -> dict:
    proc.wait(timeout=300)
    assert proc.returncode == 0, Path(f"{folder}.err").read_text()[-3000:]
    return json.loads(Path(f"{folder}.out").read_text().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """Both processes at once: each is ~8 s of imports on one core of the 2-core CI machine."""
    tmp = tmp_path_factory.mktemp("import_side_effects")
    started = [start(tmp, "without"), start(tmp, "with")]
    try:
        return finish(*started[0]), finish(*started[1])
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_import_and_the_strategy_leave_every_lightning_and_torch_name_as_it_was(both):
    without, with_import = both
    assert without["changed"] == [] and without["registered"] == []
    assert with_import["changed"] == []  # the same objects: no wrapper, no replaced attribute, nothing added
    assert with_import["registered"] == ["vitscale"]  # Lightning's public registry: Trainer(strategy="vitscale")


def test_a_ddp_run_saves_resumes_from_last_and_loads_as_without_the_import(both):
    without, with_import = both
    for key in ("last", "resumed", "loaded", "raw", "raw_keys", "step", "hparams"):
        assert with_import[key] == without[key], key
    assert with_import["last"] == "last.ckpt" and with_import["loaded"] == with_import["raw"]
    assert with_import["step"] == 8  # the resume ran steps 5-8
