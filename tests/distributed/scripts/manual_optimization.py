"""Rank script: manual optimization on 2 ranks under DDP, ``VitScaleStrategy()`` and ``priority="memory"``; per
scenario ``<case>/<strategy>`` this rank's losses and the whole final state (``tests/distributed/
test_manual_optimization.py`` says what each case checks)."""

from __future__ import annotations

import contextlib
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import grad as bound_grad  # bound before any step, as WGAN-GP code often imports it
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")
STRATEGIES = {
    "ddp": lambda: "ddp_find_unused_parameters_true",  # toggle_optimizer leaves the other network without gradients
    "default": VitScaleStrategy,
    "memory": lambda: VitScaleStrategy(priority="memory"),
}
NOISE, FEATURES = 16, 32


def mlp(width: int, into: int, out: int, blocks: int) -> nn.Sequential:
    """``blocks`` > 0: that many identical hidden layers, which the strategy makes units of their own."""
    hidden = [nn.Sequential(nn.Linear(width, width), nn.LeakyReLU(0.2)) for _ in range(blocks)]
    return nn.Sequential(nn.Linear(into, width), nn.LeakyReLU(0.2), *hidden, nn.Linear(width, out))


def real_samples() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.rand(64, FEATURES, generator=g) * 2 - 1), batch_size=4)


class GAN(L.LightningModule):
    """Lightning's basic GAN example's ``training_step``: the generator's update, then the discriminator's, each
    through ``toggle_optimizer`` (a forward after a backward and an optimizer step, in one step)."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(mlp(64, NOISE, FEATURES, blocks), nn.Tanh())
        self.discriminator = mlp(64, FEATURES, 1, blocks)
        self.losses: list[float] = []

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], NOISE, generator=torch.Generator().manual_seed(batch_idx))
        valid, fake = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        self.toggle_optimizer(g_opt)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), valid)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), valid)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.losses += [g_loss.item(), d_loss.item()]

    def configure_optimizers(self):
        adam = lambda net: torch.optim.Adam(net.parameters(), lr=2e-3, betas=(0.5, 0.999))  # noqa: E731
        return adam(self.generator), adam(self.discriminator)

    def train_dataloader(self) -> DataLoader:
        return real_samples()


class WGAN(GAN):
    """A Wasserstein GAN's step: the critic's update, its weights clipped in place (``p.data.clamp_``), then the
    generator's through the clipped critic; a write between the updates, and one to the gathered copy before the
    generator's backward (a discriminator's bias rescaled in the step, as a weight normalization would)."""

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], NOISE, generator=torch.Generator().manual_seed(batch_idx))
        self.toggle_optimizer(d_opt)
        d_loss = self.discriminator(self(z).detach()).mean() - self.discriminator(real).mean()
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        for param in self.discriminator.parameters():
            param.data.clamp_(-0.05, 0.05)
        self.toggle_optimizer(g_opt)
        g_loss = -self.discriminator(self(z)).mean()
        with torch.no_grad():
            self.discriminator[-1].bias.mul_(0.5)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.losses += [d_loss.item(), g_loss.item()]


class Regression(L.LightningModule):
    """One optimizer, manual optimization; ``micro_batches`` forward/backward pairs per optimizer step."""

    def __init__(self, micro_batches: int, blocks: int = 0, unsynced: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = mlp(64, FEATURES, 1, blocks)
        self.micro_batches = micro_batches
        self.unsynced = unsynced  # DDP's habits for the micro-batches before the last: see `before_last`
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        optimizer = self.optimizers()
        parts = x.chunk(self.micro_batches)
        for i, part in enumerate(parts):
            loss = (self.net(part) - part.sum(-1, keepdim=True)).pow(2).mean()
            with self.before_last() if i < len(parts) - 1 else contextlib.nullcontext():
                self.manual_backward(loss / self.micro_batches)
            self.losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()

    def before_last(self) -> contextlib.AbstractContextManager:
        if self.unsynced == "model":  # the DDP wrapper's own: `trainer.model` is DistributedDataParallel there
            return self.trainer.model.no_sync()
        if self.unsynced == "strategy":  # Lightning's, on any parallel strategy
            return self.trainer.strategy.block_backward_sync()
        return contextlib.nullcontext()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return real_samples()


class TwoLosses(Regression):
    """Two losses on one forward, a ``manual_backward`` for each, the first keeping the graph."""

    def training_step(self, batch, batch_idx):
        (x,) = batch
        optimizer = self.optimizers()
        out = self.net(x)
        first, second = (out - x.sum(-1, keepdim=True)).pow(2).mean(), out.pow(2).mean()
        self.manual_backward(first, retain_graph=True)
        self.manual_backward(0.1 * second)
        optimizer.step()
        optimizer.zero_grad()
        self.losses.append(first.item())


class WGANGP(GAN):
    """A WGAN-GP critic's step: the gradient penalty ``torch.autograd.grad(..., create_graph=True)`` of the critic's
    scores at points between real and generated samples, then the generator's update."""

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], NOISE, generator=torch.Generator().manual_seed(batch_idx))
        alpha = torch.rand(real.shape[0], 1, generator=torch.Generator().manual_seed(batch_idx + 99))
        self.toggle_optimizer(d_opt)
        fake = self(z).detach()
        between = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (slopes,) = torch.autograd.grad(self.discriminator(between).sum(), between, create_graph=True)
        penalty = ((slopes.norm(2, dim=1) - 1) ** 2).mean()
        d_loss = self.discriminator(fake).mean() - self.discriminator(real).mean() + 10 * penalty
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_loss = -self.discriminator(self(z)).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.losses += [d_loss.item(), g_loss.item()]


class InputGradientPenalty(L.LightningModule):
    """Automatic optimization: a classifier whose loss adds the squared gradient of its scores to its input (an R1 /
    input-gradient regularizer), through ``torch.autograd.grad(..., create_graph=True)`` in ``training_step``."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp(64, FEATURES, 4, blocks)
        self.losses: list[float] = []
        self.grad = bound_grad if blocks else torch.autograd.grad  # the units' case: imported before the step

    def training_step(self, batch, batch_idx):
        (x,) = batch
        x = x.clone().requires_grad_(True)
        y = (x.sum(-1) > 0).long() + 2 * (x[:, 0] > 0).long()
        logits = self.net(x)
        (slopes,) = self.grad(logits.logsumexp(-1).sum(), x, create_graph=True)
        loss = F.cross_entropy(logits, y) + 0.1 * slopes.pow(2).sum(-1).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return real_samples()


def critic() -> L.LightningModule:
    from tests.unit.sharding.test_frozen_in_step import Critic

    return Critic(both=True)


CASES = {
    "one_update": lambda: Regression(1),
    "accumulated": lambda: Regression(2),
    "accumulated_no_sync": lambda: Regression(2, blocks=3, unsynced="model"),
    "accumulated_block_sync": lambda: Regression(2, blocks=3, unsynced="strategy"),
    "two_losses": lambda: TwoLosses(1),
    "gan": lambda: GAN(0),
    "gan_blocks": lambda: GAN(3),
    "wgan": lambda: WGAN(0),
    "critic": critic,
    "wgan_gp": lambda: WGANGP(0),
    "wgan_gp_blocks": lambda: WGANGP(3),
    "input_penalty": lambda: InputGradientPenalty(0),
    "input_penalty_blocks": lambda: InputGradientPenalty(3),
}


def fit(case: str, strategy: str) -> dict:
    model = CASES[case]()
    # Lightning counts optimizer steps; manual optimization's are the updates
    steps = 4 * (2 if isinstance(model.configure_optimizers(), tuple) else 1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[strategy](), max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    state = {name: (value.full_tensor() if isinstance(value, DTensor) else value).flatten().tolist()
             for name, value in model.state_dict().items()}
    plan = getattr(trainer.strategy, "plan", None)
    return {"losses": model.losses, "state": state, "summary": plan.summary() if plan is not None else ""}


def resumed(strategy: str) -> dict:
    """The GAN with units of its own saved after 2 training steps (4 optimizer steps: Lightning counts both
    optimizers'), resumed to 6: both optimizers' states through the strategy's sharded checkpoint."""
    import sys
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint

    root = Path(sys.argv[1]) / f"resumed-{strategy}"

    def run(steps: int, ckpt_path: Path | None = None) -> GAN:
        model = GAN(3)
        saving = ckpt_path is None
        L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[strategy](), max_steps=steps, logger=False,
                  default_root_dir=root, enable_checkpointing=saving, enable_progress_bar=False,
                  enable_model_summary=False,
                  callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=4)] if saving else []).fit(
                      model, ckpt_path=ckpt_path)
        return model

    run(4)
    model = run(12, root / "epoch=0-step=4.ckpt")
    state = {name: (value.full_tensor() if isinstance(value, DTensor) else value).flatten().tolist()
             for name, value in model.state_dict().items()}
    return {"losses": model.losses, "state": state}


if __name__ == "__main__":
    scenarios = {f"{case}/{strategy}": (lambda c=case, s=strategy: fit(c, s))
                 for case in CASES for strategy in STRATEGIES}
    scenarios.update({f"resumed/{strategy}": (lambda s=strategy: resumed(s)) for strategy in STRATEGIES})
    run_scenarios(scenarios)
