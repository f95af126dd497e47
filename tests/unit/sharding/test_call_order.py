"""Prefetch follows the order a step calls the blocks in, not the order they were registered in: a stack run in
reverse (or interleaved from one container) would otherwise gather ahead units that already ran and hold them
gathered until their next use."""

from __future__ import annotations

from collections import Counter

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.discovery.unit_runs import in_call_order
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import ParallelConfig, ShardingPolicy
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize

DIM, DEPTH = 32, 4


def test_units_in_the_order_the_step_first_called_them():
    assert in_call_order([["b0"], ["b1"], ["b2"]], ["b2", "b1", "b0"]) == [2, 1, 0]
    assert in_call_order([["b0"], ["b1"], ["b2"], ["b3"]], ["b0", "b2", "b1", "b3"]) == [0, 2, 1, 3]
    # a unit of several blocks takes its first call's place; a block called again later changes nothing
    assert in_call_order([["b0", "b1"], ["b2", "b3"]], ["b3", "b2", "b1", "b0", "b3"]) == [1, 0]
    # one the measured step did not call (LayerDrop's draw) stays after the unit before it in model order
    assert in_call_order([["b0"], ["b1"], ["b2"]], ["b2", "b0"]) == [2, 0, 1]
    assert in_call_order([["b0"], ["b1"], ["b2"]], []) == [0, 1, 2]  # nothing measured: model order


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ReversedStack(nn.Module):
    """Blocks registered 0..n-1 and run n-1..0 (a decoder walking an encoder's list back, an FPN's top-down path)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, DIM), nn.Linear(DIM, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in reversed(self.blocks):
            x = block(x)
        return self.head(x)


def _forward_prefetch(unit: nn.Module) -> list:
    return list(unit._get_fsdp_state()._states_to_forward_prefetch or [])  # type: ignore[operator]


def test_the_chain_follows_the_measured_order(mesh):
    """Each unit prefetches the unit the measured step called next, and the first one called is gathered as the
    container's callers start. Mutation seen failing: ``apply_prefetch`` given no order (model order)."""
    model = ReversedStack()
    names = [f"blocks.{i}" for i in range(DEPTH)]
    calls = Calls(counts=Counter(["", "embed", "head", *names]), order=names[::-1])
    config = ParallelConfig(sharding=ShardingPolicy(prefetch=1, blocks_per_unit=1, reshard_after_forward=True))
    parallelize(OuterUnit(model), model, mesh, config, resolve_flag("32-true"), torch.device("cpu"), calls=calls)
    states = [block._get_fsdp_state() for block in model.blocks]  # type: ignore[operator]
    for i in range(1, DEPTH):
        assert _forward_prefetch(model.blocks[i]) == [states[i - 1]]
    assert _forward_prefetch(model.blocks[0]) == []


class ReversedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = ReversedStack()
        self.held: list[int] = []
        self.net.head.register_forward_pre_hook(self._count_held)

    def _count_held(self, *_) -> None:
        """Block units whose all-gather was issued and not yet taken by their forward (FSDP2 keeps the gathered
        parameters on the unit's state until its next pre-forward or pre-backward uses them)."""
        if self.training and all(hasattr(block, "_get_fsdp_state") for block in self.net.blocks):  # not at setup
            groups = [block._get_fsdp_state()._fsdp_param_group for block in self.net.blocks]
            self.held.append(sum(getattr(group, "_all_gather_result", None) is not None for group in groups))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator))
        return DataLoader(data, batch_size=4)


@pytest.mark.filterwarnings("ignore")
def test_a_reversed_stack_holds_no_unit_gathered_after_it_ran():
    """Through ``Trainer.fit``, every block its own unit: when the stack has run, no unit is left gathered (in model
    order each unit gathered ahead the one registered after it, which had run already: all but one held, the whole
    model's parameters, to the next step). Mutation seen failing: ``apply_prefetch`` given no order (3 held)."""
    model = ReversedModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(priority="memory"), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    summary = trainer.strategy.plan.summary()
    assert "FSDP units          : 5 (4 blocks + 1 outer)" in summary and "predicted peak" in summary
    assert model.held == [0, 0]
