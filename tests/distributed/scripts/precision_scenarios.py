"""Rank script for VitScalePrecision: dtypes in a real step, collective counts, fp16 overflow, convergence."""

from __future__ import annotations

import os
import warnings
from collections import Counter

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScalePrecision, VitScaleStrategy
from lightning_vitscale.cli.demo import TinyViT
from tests.helpers.models import IMAGE, Classifier, loader
from tests.helpers.recording import DtypeRecorder, count_collectives, linear_bf16_share
from tests.helpers.sam import SAM
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=VitScaleStrategy(), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


class Recorded(Classifier):
    def on_fit_start(self) -> None:
        self.recorder = DtypeRecorder()

    def training_step(self, batch, batch_idx):
        with self.recorder:
            return super().training_step(batch, batch_idx)


def dtypes(flag: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = Recorded("timm")
    t = trainer(precision=flag, max_steps=2)
    t.fit(model, loader(n=32))
    state = [v for s in t.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    norm_params = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    return {
        "calls": [[*k, v] for k, v in model.recorder.calls.items()],
        "linear_bf16_share": linear_bf16_share(model.recorder.calls),
        "param_dtypes": dict(Counter(str(p.dtype) for p in model.parameters() if id(p) not in norm_params)),
        "norm_param_dtypes": dict(Counter(str(p.dtype) for p in model.parameters() if id(p) in norm_params)),
        "state_dtypes": dict(Counter(str(v.dtype) for v in state)),
        "fp32_modules": len(t.strategy.plan.fp32_modules),
        "finite": all(loss == loss for loss in model.losses),
    }


class Deep(L.LightningModule):
    """8 pre-norm blocks, 17 LayerNorms: the collective-count workload (one FSDP unit per norm would add ~2 x 17
    collectives to ~24 per step; 24 blocks showed the same, 3x slower)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyViT(image=8, patch=4, dim=32, depth=8)

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:  # after lazy init, one whole optimizer step
            with count_collectives() as counts:
                loss = F.cross_entropy(self.net(batch[0]), batch[1])
                self.manual_backward(loss)
                self.optimizers().step()
                self.optimizers().zero_grad()
            self.counts = dict(counts)
        else:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.manual_backward(loss)
            self.optimizers().step()
            self.optimizers().zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    @property
    def automatic_optimization(self) -> bool:
        return False


def collectives(norms: bool) -> dict:
    L.seed_everything(0, verbose=False)
    model = Deep()
    data = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,)))
    # The non-finite guard's own all-reduce (one per step, README "Non-finite step guard") is not what is counted.
    plugin = VitScalePrecision("bf16-mixed", norms=None if norms else False, skip_nonfinite=False)
    # A unit per block, pinned: the many-unit workload this counts, whatever the planner would choose.
    t = trainer(plugins=[plugin], max_steps=2, strategy=VitScaleStrategy(blocks_per_unit=1))
    t.fit(model, DataLoader(data, batch_size=4))
    return {"counts": model.counts, "total": sum(model.counts.values()), "fp32": len(t.strategy.plan.fp32_modules)}


class RawBackward(Deep):
    """Manual optimization calling ``loss.backward()`` itself, not ``manual_backward``: under DDP its hooks still
    average every gradient, so the replicas stay equal; the fp32 norms must be averaged too."""

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        loss.backward()
        self.optimizers().step()
        self.optimizers().zero_grad()


def raw_backward() -> dict:
    """Each rank's norm weights after 3 steps on its own data (DistributedSampler): equal across ranks if the norm
    gradients were averaged."""
    L.seed_everything(0, verbose=False)
    model = RawBackward()
    data = TensorDataset(torch.randn(24, 3, 8, 8), torch.randint(0, 10, (24,)))
    t = trainer(precision="bf16-mixed", max_steps=3)
    t.fit(model, DataLoader(data, batch_size=4))
    norms = [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    return {"fp32": len(t.strategy.plan.fp32_modules), "norm_values": [p.to_local().tolist() for p in norms]}


class Overflowing(Classifier):
    """At step 2 only rank 1's loss overflows: every rank must skip that step, and the scale must drop."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 2 and self.global_rank == 1:
            loss = loss * float("inf")
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.before = [p.to_local().detach().clone() for p in self.parameters()]
        self.scale_before = self.trainer.precision_plugin.scaler.get_scale()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        changed = any(not torch.equal(a, p.to_local()) for a, p in zip(self.before, self.parameters()))
        self.steps = getattr(self, "steps", []) + [
            {"changed": changed, "scale_before": self.scale_before,
             "scale_after": self.trainer.precision_plugin.scaler.get_scale()}
        ]


def fp16_overflow() -> dict:
    L.seed_everything(0, verbose=False)
    model = Overflowing("encoder")
    plugin = VitScalePrecision("16-mixed")
    t = trainer(plugins=[plugin], max_steps=4)
    t.fit(model, loader(n=64))
    return {"steps": model.steps, "scaler_state": {k: float(v) for k, v in plugin.state_dict().items()}}


class NaNOnRank1(Classifier):
    """Rank 1's loss is NaN at the listed batches only (the other rank's is finite)."""

    def __init__(self, nan_batches: set[int], fused: bool = False) -> None:
        super().__init__("encoder")
        self.nan_batches, self.fused = nan_batches, fused
        self.changed: list[bool] = []

    def configure_optimizers(self):
        if not self.fused:
            return super().configure_optimizers()
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05, fused=True)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_rank == 1 and batch_idx in self.nan_batches else loss

    def on_train_batch_start(self, batch, batch_idx):
        self.before = [p.to_local().detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.changed.append(any(not torch.equal(a, p.to_local()) for a, p in zip(self.before, self.parameters())))


def nonfinite(flag: str, nan_batches: set[int], max_skipped: int = 3, fused: bool = False) -> dict:
    """``fused``: the guard hands its decision to the fused step (``found_inf``) and reads it a step later."""
    L.seed_everything(0, verbose=False)
    model = NaNOnRank1(nan_batches, fused)
    plugin = VitScalePrecision(flag, max_skipped_steps=max_skipped)
    t = trainer(plugins=[plugin], max_steps=5, limit_val_batches=0)
    error = None
    try:
        t.fit(model, loader(n=64))
    except Exception as e:  # noqa: BLE001 - the stop is what the scenario records
        error = f"{type(e).__name__}: {e}"
    return {
        "changed": model.changed,
        "error": error,
        "skipped": plugin.nonfinite_guard.skipped if plugin.nonfinite_guard is not None else None,
        "decided_on_device": plugin.nonfinite_guard.decided_on_device if plugin.nonfinite_guard is not None else 0,
        "finite_weights": all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters()),
    }


class DigitsViT(TinyViT):
    def __init__(self) -> None:
        super().__init__(image=8, patch=4, dim=32, depth=2)
        self.patch_embed = nn.Conv2d(1, 32, 4, 4)
        self.correct = 0
        self.total = 0

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x).argmax(-1)
        self.correct += int((pred == y).sum())
        self.total += len(y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=5e-3, weight_decay=0.05)
        steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=steps, pct_start=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def digits_data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    train, val = order[:1400], order[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def convergence(flag: str) -> dict:
    L.seed_everything(0, verbose=False)
    train, val = digits_data()
    model = DigitsViT()
    # Checkpointing off: this test is about precision, and a 2-block model has no activations to save.
    strategy = VitScaleStrategy(activation_checkpointing=False)
    # 4 epochs: 0.962 accuracy under both precisions (8 epochs: 0.967, twice the time; 3 epochs: 0.92).
    t = trainer(precision=flag, max_epochs=4, check_val_every_n_epoch=4, strategy=strategy)
    t.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=100))
    counts = t.strategy.reduce(torch.tensor([model.correct, model.total], dtype=torch.float64), reduce_op="sum")
    return {"accuracy": float(counts[0] / counts[1])}


def o2_by_hand(flag: str = "bf16-mixed") -> dict:
    """``Trainer.fit`` under ``precision=flag`` and the recipe's O2 written out by hand, from the same weights and
    data: each step's loss and, after the last, every parameter and saved buffer."""
    from tests.helpers.o2_reference import compare_with_o2_by_hand

    return compare_with_o2_by_hand(trainer, flag)


class ShardBlindSGD(torch.optim.Optimizer):
    """Normalized SGD written for whole tensors that steps a DTensor through its local shard: each shard normalized by
    its own norm, other numbers than DDP's and nothing raised (what a step reading ``to_local()`` does)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._update()
        return loss

    def _update(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    local = p.to_local() if isinstance(p, DTensor) else p
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    local.sub_(group["lr"] * grad / (grad.norm() + 1e-6))


class WithOptimizer(Classifier):
    def __init__(self, make) -> None:
        super().__init__("timm")
        self.make = make

    def configure_optimizers(self):
        return self.make(self.parameters())


def _replicated(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and all(placement.is_replicate() for placement in param.placements)


def timm_lamb(params) -> torch.optim.Optimizer:
    from timm.optim import Lamb

    return Lamb(params, lr=1e-2)


OPTIMIZERS = {
    "rprop": lambda params: torch.optim.Rprop(params, lr=1e-3),  # elementwise: steps the local shards
    "lamb": lambda params: timm_lamb(params),  # per-parameter norms: steps the DTensors
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),  # no DTensor rule for its in-place pow_
    "lbfgs": lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=3),  # one flat vector of every parameter
    # sharpness-aware: the gradient norm over every parameter, two closure runs a step; ASAM scales by |w|
    "sam": lambda params: SAM(params, torch.optim.SGD, rho=0.5, lr=0.05, momentum=0.9),
    "asam": lambda params: SAM(params, torch.optim.SGD, rho=2.0, adaptive=True, lr=0.05, momentum=0.9),
    # bf16-mixed, the fp32 norms' replicated parameters first (a shard is the whole): the probe must shard its own
    "shard_blind": lambda params: ShardBlindSGD(params),  # steps shards as wholes: other numbers
    "shard_blind_norms_first": lambda params: ShardBlindSGD(sorted(params, key=lambda p: not _replicated(p))),
}


def optimizers() -> dict:
    """Each optimizer through ``Trainer.fit`` for 3 steps under DDP and VitScaleStrategy: the losses, or the error
    (and how many steps ran before it)."""
    found = {}
    for name, make in OPTIMIZERS.items():
        for strategy in ("ddp", "vitscale"):
            L.seed_everything(0, verbose=False)
            model = WithOptimizer(make)
            precision = "bf16-mixed" if name.endswith("norms_first") else "32-true"
            t = trainer(max_steps=3, strategy=VitScaleStrategy() if strategy == "vitscale" else "ddp",
                        precision=precision)
            try:
                t.fit(model, loader(n=32))
                found[f"{name}/{strategy}"] = {"losses": model.losses}
            except Exception as error:  # noqa: BLE001 - the refusal is what the test reads
                found[f"{name}/{strategy}"] = {"error": f"{type(error).__name__}: {error}", "losses": model.losses}
    return found


class FullPrecisionHead(L.LightningModule):
    """A head the step computes in fp32 on purpose: ``torch.autocast(..., enabled=False)`` around it, its input made
    fp32, as numerically careful code does under DDP's AMP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyViT(image=IMAGE, patch=8, dim=32, depth=2, classes=16)
        self.head = nn.Linear(16, 10)
        self.losses: list[float] = []
        self.dtypes: list[str] = []

    def training_step(self, batch, batch_idx):
        features = self.net(batch[0])
        with torch.autocast(features.device.type, enabled=False):
            logits = self.head(features.float())
        self.dtypes.append(str(logits.dtype))
        loss = F.cross_entropy(logits, batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def full_precision_head() -> dict:
    """Under DDP's AMP the head computes in fp32; under O2 it did in bf16 (its weight gathered in bf16, its input cast
    back by the outer unit), the user's fp32 region silently ignored. Measured: the dtype of the head's output in
    each step, the losses, and the summary's note."""
    found = {}
    for name, strategy in {"ddp": "ddp", "default": VitScaleStrategy(),
                           "memory": VitScaleStrategy(priority="memory")}.items():
        L.seed_everything(0, verbose=False)
        model = FullPrecisionHead()
        t = trainer(strategy=strategy, precision="bf16-mixed", max_steps=3)
        t.fit(model, loader(n=24))
        notes = t.strategy.plan.notes if name != "ddp" else []
        found[name] = {"losses": model.losses, "dtypes": model.dtypes, "notes": notes}
    return found


class ConvolutionDtypes(TorchDispatchMode):
    """(input dtype, weight dtype) of every convolution as it computes: below autocast, which casts F.conv2d's
    arguments after a TorchFunctionMode sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.calls[(str(args[0].dtype), str(args[1].dtype))] += 1
        return func(*args, **(kwargs or {}))


class WeightStandardized(L.LightningModule):
    """BiT's layout (timm ResNetV2): every convolution standardizes its weight with F.batch_norm in its forward."""

    def __init__(self) -> None:
        super().__init__()
        from functools import partial

        from timm.layers import GroupNormAct
        from timm.models.resnetv2 import ResNetV2

        self.net = ResNetV2(layers=[1, 1], channels=(32, 64), stem_chs=16, num_classes=10,
                            norm_layer=partial(GroupNormAct, num_groups=8))
        self.losses: list[float] = []

    def on_fit_start(self) -> None:
        self.recorder = ConvolutionDtypes()

    def training_step(self, batch, batch_idx):
        with self.recorder:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def weight_standardized() -> dict:
    """Under bf16-mixed, which modules the plan keeps fp32, in which dtype the convolutions ran, whether their
    weights are sharded, and the losses beside DDP's AMP."""
    found = {}
    for name, strategy in {"ddp": "ddp", "default": VitScaleStrategy()}.items():
        L.seed_everything(0, verbose=False)
        model = WeightStandardized()
        t = trainer(strategy=strategy, precision="bf16-mixed", max_steps=3)
        t.fit(model, loader(n=24))
        convs = [m.weight for m in model.modules() if type(m).__name__ == "StdConv2d"]
        found[name] = {
            "losses": model.losses,
            "conv_calls": [[*k, v] for k, v in model.recorder.calls.items()],
            "fp32_modules": sorted({type(model.get_submodule(n)).__name__ for n in t.strategy.plan.fp32_modules})
            if name != "ddp" else [],
            "convs": len(convs),
            "convs_sharded": sum(isinstance(w, DTensor) and w.placements[0].is_shard() for w in convs),
        }
    return found


SCENARIOS = {
    "o2_by_hand": o2_by_hand,
    "optimizers": optimizers,
    "dtypes_bf16_mixed": lambda: dtypes("bf16-mixed"),
    "dtypes_bf16_true": lambda: dtypes("bf16-true"),
    "collectives_fp32_norms": lambda: collectives(True),
    "collectives_bf16_norms": lambda: collectives(False),
    "fp16_overflow": fp16_overflow,
    "convergence_fp32": lambda: convergence("32-true"),
    "convergence_bf16": lambda: convergence("bf16-mixed"),
    "nonfinite_bf16_skip": lambda: nonfinite("bf16-mixed", {2}),
    "nonfinite_bf16_stop": lambda: nonfinite("bf16-mixed", {1, 2, 3, 4}, max_skipped=2),
    "nonfinite_fp32_off": lambda: nonfinite("32-true", {2}),
    "nonfinite_bf16_skip_fused": lambda: nonfinite("bf16-mixed", {2}, fused=True),
    "nonfinite_bf16_stop_fused": lambda: nonfinite("bf16-mixed", {1, 2, 3, 4}, max_skipped=2, fused=True),
    "raw_backward": raw_backward,
    "full_precision_head": full_precision_head,
    "weight_standardized": weight_standardized,
}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
