"""Every read of a whole sharded folder for use elsewhere checks the CRC-32s its marker records: ``export``,
``consolidate`` (no flag needed), ``read_weights`` (the examples' ``--model.weights``) and Lightning's
``load_from_checkpoint(consolidated(folder))`` refuse one flipped byte with one line naming the file, and write nothing;
``--no-verify`` / ``verify=False`` read it anyway.

Mutation seen failing: ``load_consolidated`` without its ``verify_folder`` call (every refusal here: export wrote
a safetensors file whose weight held the flipped value, as in issue 49).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_vitscale.__main__ import main
from lightning_vitscale.checkpoint import CheckpointError, consolidated, load_consolidated
from lightning_vitscale.checkpoint.export import read_weights
from tests.helpers.saved_runs import save_run

pytestmark = pytest.mark.timeout(60)


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, Path]:
    """A sharded folder with one byte of its one shard flipped, and that shard."""
    torch.manual_seed(0)
    folder = save_run(tmp_path / "run" / "last.ckpt", Net())
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return folder, shard


@pytest.mark.parametrize("command", [["export"], ["export", "--format", "hf"], ["consolidate"]])
def test_the_commands_refuse_a_flipped_byte_naming_the_file_and_write_nothing(damaged, tmp_path, capsys, command):
    folder, shard = damaged
    dst = tmp_path / "out" / "model.safetensors"
    assert main([*command, str(folder), str(dst)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(shard) in err and "fails its CRC-32 check" in err, err
    assert not (tmp_path / "out").exists()  # nothing written, not even a temporary file or the folder


def test_no_verify_reads_the_damaged_folder(damaged, tmp_path):
    folder, _ = damaged
    assert main(["export", "--no-verify", str(folder), str(tmp_path / "w.safetensors")]) == 0
    assert main(["consolidate", "--no-verify", str(folder), str(tmp_path / "w.ckpt")]) == 0
    assert read_weights(folder, verify=False).state["fc.weight"].shape == (64, 64)
    assert main(["consolidate", "--no-verify", str(folder)]) == 2  # nothing to do: neither a check nor a DST


def test_python_reads_refuse_it_too(damaged):
    folder, shard = damaged
    for read in (lambda: read_weights(folder), lambda: load_consolidated(folder),
                 lambda: Net.load_from_checkpoint(consolidated(folder))):  # fmt: skip
        with pytest.raises(CheckpointError, match="fails its CRC-32 check") as error:
            read()
        assert str(shard) in str(error.value)
