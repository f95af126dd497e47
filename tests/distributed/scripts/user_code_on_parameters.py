"""Rank script: user code on the parameters under DDP and under ``VitScaleStrategy()`` / ``priority="memory"`` on 2
ranks, per scenario ``<case>/<strategy>`` this rank's results:

- ``<update>-<where>``: a momentum encoder updated by user code (``tests/helpers/momentum.py``): the losses and the
  teacher's whole parameters after 4 steps;
- ``toggled``: a generator trained against a critic, the critic frozen by ``toggle_optimizer`` inside the step
  (``tests/unit/sharding/test_frozen_in_step.py``'s module): the losses, the critic and whether it holds gradients;
- ``logged``: ``self.log(..., sync_dist=True)`` in ``on_before_optimizer_step`` of the sharded gradients' squared sum
  and of one sharded weight's norm: the losses and the logged values;
- ``inputs-<manual|automatic>``: a backward given ``inputs=`` (the network's parameters, as a GAN's generator step
  names its own): through ``self.manual_backward`` in a manual step, or an overridden ``LightningModule.backward``;
  the losses and the whole parameters after 4 steps;
- ``penalty-<term>-<where>[-<precision>]``: a term on the parameters added to the loss in ``training_step``
  (``tests/helpers/penalties.py``) before or after the forward: the losses and the whole parameters after 4 steps;
- ``forced-norm``: blocks writing their own weight normalized in ``forward`` (EDM2's forced weight normalization,
  ``tests/unit/sharding/test_parameter_writes.py``'s module): the losses and the whole parameters after 3 steps;
- ``grad-hooks``: gradient hooks registered in ``__init__`` (a token frozen, rows masked, a norm's weight frozen:
  ``tests/unit/sharding/test_user_grad_hooks.py``'s module): the losses and the whole parameters after 3 steps.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.helpers.momentum import STRATEGIES, fit_momentum, images, teacher_state
from tests.helpers.penalties import PENALTY_CASES, fit_penalty
from tests.helpers.scenarios import run_scenarios
from tests.helpers.zoo import FunctionalAttention, hand_written

warnings.filterwarnings("ignore")
MOMENTUM_CASES = [("lightly", "start"), ("dino", "between"), ("dino", "end"), ("lightly", "batch_end")]


class Logging(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = hand_written(FunctionalAttention)
        self.losses: list[float] = []
        self.logged: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        squares = sum(p.grad.pow(2).sum() for p in self.parameters() if p.grad is not None)
        self.log("grad_squares", squares, sync_dist=True)
        self.log("weight_norm", self.net.layers[0].fc1.weight.norm(), sync_dist=True)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        metrics = self.trainer.callback_metrics
        self.logged.append([float(metrics["grad_squares"]), float(metrics["weight_norm"])])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(images(), batch_size=4)


def momentum(update: str, where: str, strategy: str) -> dict:
    model = fit_momentum(STRATEGIES[strategy](), update, where, devices=2)
    return {"losses": model.losses,
            "teacher": {name: value.flatten().tolist() for name, value in teacher_state(model).items()}}


def toggled(strategy: str) -> dict:
    from tests.unit.sharding.test_frozen_in_step import Critic, critic_state

    model = Critic(both=False)
    chosen = "ddp_find_unused_parameters_true" if strategy == "ddp" else STRATEGIES[strategy]()  # the frozen critic
    L.Trainer(accelerator="cpu", devices=2, strategy=chosen, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model)
    return {"losses": model.losses, "critic": {k: v.flatten().tolist() for k, v in critic_state(model).items()},
            "critic_gradients": [p.grad is not None for p in model.critic.parameters()]}


def logged(strategy: str) -> dict:
    model = Logging()
    L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[strategy](), max_steps=4, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
    return {"losses": model.losses, "logged": model.logged}


class RestrictedBackward(L.LightningModule):
    """A backward given ``inputs=`` (the network's parameters; the loss reaches nothing else)."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = hand_written(FunctionalAttention)
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss, inputs=list(self.net.parameters()))
        optimizer.step()
        return None

    def backward(self, loss, *args, **kwargs) -> None:  # overridden: automatic optimization's names them here
        kwargs.setdefault("inputs", list(self.net.parameters()))
        loss.backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(images(), batch_size=4)


def restricted(mode: str, strategy: str) -> dict:
    model = RestrictedBackward(manual=mode == "manual")
    L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[strategy](), max_steps=4, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
    whole = {name: v.full_tensor() if isinstance(v, DTensor) else v for name, v in model.state_dict().items()}
    return {"losses": model.losses, "weights": {name: v.flatten().tolist() for name, v in whole.items()}}


def penalty(case: str, strategy: str) -> dict:
    model = fit_penalty(case, STRATEGIES[strategy](), devices=2)
    return {"losses": model.losses, "weights": model.whole_weights(), "probed": model.probed}


def forced_norm(strategy: str) -> dict:
    from tests.unit.sharding.test_parameter_writes import ForcedNormModel

    model = ForcedNormModel()
    L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[strategy](), max_steps=3, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
    whole = {name: v.full_tensor() if isinstance(v, DTensor) else v for name, v in model.state_dict().items()}
    return {"losses": model.losses, "weights": {name: v.flatten().tolist() for name, v in whole.items()}}


def grad_hooks(strategy: str) -> dict:
    from tests.unit.sharding.test_user_grad_hooks import fit_hooked, whole_state

    model, start = fit_hooked(STRATEGIES[strategy](), devices=2)
    whole = whole_state(model)
    return {"losses": model.losses, "weights": {name: v.flatten().tolist() for name, v in whole.items()},
            "start": {name: v.flatten().tolist() for name, v in start.items()}}


if __name__ == "__main__":
    scenarios = {f"{update}-{where}/{strategy}": (lambda u=update, w=where, s=strategy: momentum(u, w, s))
                 for update, where in MOMENTUM_CASES for strategy in STRATEGIES}
    scenarios.update({f"logged/{strategy}": (lambda s=strategy: logged(s)) for strategy in STRATEGIES})
    scenarios.update({f"toggled/{strategy}": (lambda s=strategy: toggled(s)) for strategy in STRATEGIES})
    scenarios.update({f"inputs-{mode}/{strategy}": (lambda m=mode, s=strategy: restricted(m, s))
                      for mode in ("manual", "automatic") for strategy in STRATEGIES})
    scenarios.update({f"penalty-{case}/{strategy}": (lambda c=case, s=strategy: penalty(c, s))
                      for case in PENALTY_CASES for strategy in STRATEGIES})
    scenarios.update({f"forced-norm/{strategy}": (lambda s=strategy: forced_norm(s)) for strategy in STRATEGIES})
    scenarios.update({f"grad-hooks/{strategy}": (lambda s=strategy: grad_hooks(s)) for strategy in STRATEGIES})
    run_scenarios(scenarios)
