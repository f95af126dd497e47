"""Gradient hooks a model registers on its parameters in ``__init__`` act as under DDP (``user_grad_hooks.py``): a
token frozen by a zeroing hook, half of a block weight's rows masked, a norm's weight frozen the same way. One
device here (the compute copies, and FSDP2's gathered parameters under ``priority="memory"``; a 0-dim parameter's
leaf); 2 ranks in
``tests/distributed/test_user_code_on_parameters.py``."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.sharding.parameter_writes import ParameterWriteError

DIM = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _mask_rows(grad: torch.Tensor) -> torch.Tensor:
    masked = grad.clone()
    masked[:DIM] = 0
    return masked


class Hooked(L.LightningModule):
    """``hooks_at``: ``"init"`` registers the hooks in ``__init__``, ``"fit_start"`` in ``on_fit_start``."""

    def __init__(self, hooks_at: str = "init") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(8, DIM), nn.Linear(DIM, 4)
        self.token = nn.Parameter(torch.randn(DIM))
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim: held replicated (``scalar_parameters.py``)
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.hooks_at = hooks_at
        self.losses: list[float] = []
        if hooks_at == "init":
            self.register_hooks()

    def register_hooks(self) -> None:
        self.token.register_hook(torch.zeros_like)  # frozen by its hook
        self.scale.register_hook(torch.zeros_like)
        self.blocks[1].fc1.weight.register_hook(_mask_rows)  # half of its rows frozen
        self.blocks[2].norm.weight.register_hook(torch.zeros_like)  # a norm's (fp32, replicated) weight frozen

    def on_fit_start(self) -> None:
        if self.hooks_at == "fit_start":
            self.register_hooks()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(self.blocks(self.embed(x) + self.token).mean(1)) * self.scale, y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(16, 5, 8, generator=generator),
                                              torch.randint(0, 4, (16,), generator=generator))
        return torch.utils.data.DataLoader(data, batch_size=4)


def fit_hooked(strategy, hooks_at: str = "init", devices: int = 1, precision: str = "32-true"
               ) -> tuple[Hooked, dict[str, torch.Tensor]]:
    """The fitted module and its starting state."""
    model = Hooked(hooks_at)
    start = {name: value.clone() for name, value in model.state_dict().items()}
    L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_steps=3, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
    return model, start


def whole_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: v.full_tensor() if isinstance(v, DTensor) else v for name, v in model.state_dict().items()}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("options", [{}, {"priority": "memory"}], ids=["speed", "memory"])
def test_hooks_registered_in_init_act_as_under_ddp(options):
    """Before: every hook ignored (the token moved, the masked rows and the norm's weight trained). Mutation seen
    failing: ``UserGradientHooks.install`` not called (both)."""
    ddp, start = fit_hooked("ddp")
    ours, _ = fit_hooked(VitScaleStrategy(**options))
    _assert_frozen_by_hooks(whole_state(ours), start)
    state = whole_state(ours)
    assert ours.losses == ddp.losses
    for name, value in ddp.state_dict().items():
        assert torch.equal(state[name], value), name


def _assert_frozen_by_hooks(state: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    assert torch.equal(state["token"], start["token"]) and torch.equal(state["scale"], start["scale"])
    assert torch.equal(state["blocks.1.fc1.weight"][:DIM], start["blocks.1.fc1.weight"][:DIM])
    assert torch.equal(state["blocks.2.norm.weight"], start["blocks.2.norm.weight"])
    assert not torch.equal(state["blocks.1.fc1.weight"][DIM:], start["blocks.1.fc1.weight"][DIM:])


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("options", [{}, {"priority": "memory"}], ids=["speed", "memory"])
def test_under_bf16_mixed_the_hooks_reach_the_norms_fp32_leaves_too(options):
    """O2 keeps norms in fp32, replicated, computing on leaves of their own (``precision/norms.py``): a hook on a
    norm's weight runs there; the others on the bf16 gathered parameters or compute copies. Mutation seen failing:
    without the norms' leaves (``memory``: the norm's weight trained)."""
    ours, start = fit_hooked(VitScaleStrategy(**options), precision="bf16-mixed")
    _assert_frozen_by_hooks(whole_state(ours), start)


@pytest.mark.filterwarnings("ignore")
def test_a_hook_registered_on_a_sharded_parameter_after_setup_is_refused_naming_where():
    with pytest.raises(ParameterWriteError, match="Register it before fit, in `__init__` or `configure_model`"):
        fit_hooked(VitScaleStrategy(priority="memory"), hooks_at="fit_start")
