"""CPU offload on CUDA: a model whose sharded state (fp32 weights + gradients + AdamW state) exceeds a memory cap
set here trains under that cap only with ``offload="cpu"``, in bf16 O2 with activation checkpointing and clipping, and
resumes from its sharded checkpoint. Skipped without CUDA."""

from __future__ import annotations

import gc

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

DIM, DEPTH = 1024, 8  # 8 blocks x 8.4M parameters = 67M: 268 MiB of fp32 weights, ~1.07 GB with grads + AdamW
CAP_BYTES = 700 * 2**20  # below weights + grads + AdamW state (~1,070 MB), far above one gathered bf16 block


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Big(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[MLPBlock() for _ in range(DEPTH)])
        self.head = nn.Linear(DIM, 4)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(self.blocks(x).mean(1)), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def on_train_start(self) -> None:
        self.restored = {n: _full(p) for n, p in self.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    """One GPU: a DTensor's local shard is the whole tensor (read without a collective: offloaded shards live
    on the CPU, where NCCL cannot gather them)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    assert local.shape == t.shape
    return local.detach().cpu().clone()


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 16, DIM, generator=g), torch.randint(0, 4, (16,), generator=g)),
                      batch_size=4)


def _fit(offload: str | None, steps: int, ckpt: str | None = None) -> tuple[Big, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = Big()
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=VitScaleStrategy(offload=offload), precision="bf16-mixed",
        max_steps=steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, _data(), ckpt_path=ckpt)
    return model, trainer


def _fails_without_offload() -> str:
    try:
        _fit(None, 2)
    except torch.OutOfMemoryError as error:
        return str(error)
    return "no error"


@pytest.fixture
def memory_cap():
    """The cap on this test's own allocations: what the process still holds (workspaces, a library's cache)
    comes on top; the test asserts the peak over that baseline."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((CAP_BYTES + torch.cuda.memory_reserved()) / total)
    torch.cuda.reset_peak_memory_stats()
    yield torch.cuda.memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_offload_trains_a_model_whose_state_exceeds_the_cap_and_resumes(memory_cap, tmp_path):
    baseline = memory_cap
    model, trainer = _fit("cpu", 3)
    assert trainer.strategy.plan.offload == "cpu"
    block_weight = model.blocks[0].fc1.weight
    assert isinstance(block_weight, DTensor) and block_weight.to_local().device.type == "cpu"
    assert block_weight.grad is None or block_weight.grad.to_local().device.type == "cpu"
    states = [s["exp_avg"] for p, s in trainer.optimizers[0].state.items() if p is block_weight]
    assert states and states[0].to_local().device.type == "cpu"  # the optimizer stepped on the CPU
    assert model.blocks[0].norm.weight.dtype == torch.float32  # fp32 norms under bf16 O2
    assert all(torch.isfinite(torch.tensor(model.losses))) and len(model.losses) == 3
    assert torch.cuda.max_memory_allocated() - baseline < CAP_BYTES
    saved = {n: _full(p) for n, p in model.named_parameters()}
    trainer.save_checkpoint(tmp_path / "offload.ckpt")
    del model, trainer
    gc.collect()

    resumed, trainer = _fit("cpu", 4, ckpt=str(tmp_path / "offload.ckpt"))
    assert trainer.global_step == 4
    assert all(torch.equal(saved[n], resumed.restored[n]) for n in saved)
    del resumed, trainer
    gc.collect()
    torch.cuda.empty_cache()

    # The same job without offload does not fit under the cap: the state itself is too large.
    assert "out of memory" in _fails_without_offload().lower()
