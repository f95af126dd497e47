"""The default recipe on a real GPU: kernels="auto" vs eager, BF16 O2 dtypes, sharded save and resume on CUDA."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_vitscale.cli.demo import TinyViT, generated_images
from lightning_vitscale.kernels import KernelPolicy
from lightning_vitscale.strategy import VitScaleStrategy
from tests.helpers.recording import DtypeRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _fit(model: L.LightningModule, strategy, precision: str, steps: int, data, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, precision=precision, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        **{"enable_checkpointing": False, **kwargs},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return trainer


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for n, p in model.named_parameters()}


def test_compiled_kernels_match_eager_at_bf16_tolerance():
    """``kernels="auto"``'s compiled path (compiled blocks, fused AdamW, attention decision) trains like eager
    kernels. Spelled out: ``"auto"`` compiles only where the planner predicts it pays, and TinyViT's step is
    host-bound (tests/unit/benchmarks/test_throughput_model.py holds the rule)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runs = {}
    compiled = KernelPolicy(compile_blocks=True, attention="auto", fused_optimizer=True)
    for kernels in ("eager", "auto"):
        L.seed_everything(0, verbose=False)
        model = TinyViT(dim=128, depth=4)
        strategy = VitScaleStrategy(kernels=compiled if kernels == "auto" else "eager")
        trainer = _fit(model, strategy, "bf16-mixed", 10, DataLoader(generated_images(320), batch_size=32))
        runs[kernels] = (model, trainer)
    (eager, eager_trainer), (auto, auto_trainer) = runs["eager"], runs["auto"]
    facts = auto_trainer.strategy.plan.kernels
    assert facts["compiled blocks"].endswith("Block x4") and facts["fused optimizer"] == "on"
    assert facts["attention"].startswith(("sdpa", "xformers"))  # decided (or SDPA where xformers cannot run)
    assert eager_trainer.strategy.plan.kernels["compiled blocks"] == "off"
    assert auto_trainer.optimizers[0].param_groups[0]["fused"] is True
    assert not eager_trainer.optimizers[0].param_groups[0].get("fused")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert len(auto.losses) == len(eager.losses) == 10
    torch.testing.assert_close(torch.tensor(auto.losses), torch.tensor(eager.losses), rtol=3e-2, atol=3e-2)
    assert auto.losses[-1] < auto.losses[0]


class _DtypesAtStep(Callback):
    """Gradient and optimizer-state dtypes as the optimizer sees them."""

    def __init__(self) -> None:
        self.grads: set[torch.dtype] = set()
        self.state: set[torch.dtype] = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads |= {p.grad.dtype for p in pl_module.parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        opt = trainer.optimizers[0]
        self.state |= {v.dtype for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}


def test_bf16_mixed_is_o2_on_cuda_gathered_bf16_master_fp32_norms_fp32():
    class Recorded(TinyViT):
        def training_step(self, batch, batch_idx):
            with self.recorder:
                return super().training_step(batch, batch_idx)

    L.seed_everything(0, verbose=False)
    model = Recorded(dim=128, depth=2)
    model.recorder = DtypeRecorder()
    gathered: dict[str, set[torch.dtype]] = defaultdict(set)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.register_forward_hook(
                lambda m, args, out, name=name: gathered[type(m).__name__].add(m.weight.dtype)
            )
    dtypes = _DtypesAtStep()
    _fit(model, VitScaleStrategy(kernels="eager"), "bf16-mixed", 3, DataLoader(generated_images(96), batch_size=32),
         callbacks=[dtypes])
    assert gathered["Linear"] == {torch.bfloat16}  # parameters all-gathered in the compute dtype
    assert gathered["LayerNorm"] == {torch.float32}
    norms = {(x, w) for op, x, w in model.recorder.calls if op == "layer_norm"}
    assert norms == {("torch.float32", "torch.float32")}  # norms compute in fp32 on fp32 weights
    assert {w for op, x, w in model.recorder.calls if op == "linear"} == {"torch.bfloat16"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # sharded master weights
    assert all(p.is_cuda for p in model.parameters())
    assert dtypes.grads == {torch.float32} and dtypes.state == {torch.float32}
    assert all(torch.isfinite(torch.tensor(model.losses)))


def test_sharded_checkpoint_saves_and_resumes_on_cuda(tmp_path: Path):
    """A DCP folder written mid-run on CUDA resumes to the same losses and weights as the uninterrupted run."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    # every item is the same whole batch: proof against the sampler's shuffling and against where a resume restarts
    same_batch = DataLoader([(x, y)] * 8, batch_size=None)
    L.seed_everything(0, verbose=False)
    straight = TinyViT(dim=64, depth=2)  # no dropout: Lightning does not checkpoint the global RNG
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, save_last=False)
    _fit(straight, VitScaleStrategy(kernels="eager"), "32-true", 6, same_batch, enable_checkpointing=True,
         callbacks=[saver])
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file(), sorted(p.name for p in tmp_path.iterdir())

    L.seed_everything(1, verbose=False)  # other initial weights: everything must come from the checkpoint
    resumed = TinyViT(dim=64, depth=2)
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=VitScaleStrategy(kernels="eager"), precision="32-true", max_steps=6,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(resumed, same_batch, ckpt_path=str(ckpt))
    assert trainer.global_step == 6 and len(resumed.losses) == 3
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses[3:]), rtol=1e-4, atol=1e-5)
    got, want = _full(resumed), _full(straight)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
