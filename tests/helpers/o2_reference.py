"""The recipe's bf16 "O2" written out by hand, as the oracle for ``precision="bf16-mixed"``: a compute copy of the
model in bf16 (norm layers in fp32, taking fp32 inputs and handing bf16 on; saved floating buffers in fp32, their
owner under autocast, its output back in its input's dtype; unsaved ones in bf16; a parametrization's arithmetic in
fp32 on its bf16 originals, the weight it makes handed on in bf16), refreshed from fp32 master
weights before each step; the step's own code (the loss) under autocast, as DDP's AMP runs it; the bf16 gradients
averaged over the ranks in fp32 onto the masters, which the optimizer steps; rank 0's buffers broadcast before each
forward, as DDP does. The same data order as Lightning's ``DistributedSampler`` under DDP, so a run of it is
comparable step for step with a ``Trainer.fit``."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.nn.utils.parametrize import ParametrizationList
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from lightning_vitscale.discovery import is_normalization

STEPS, BATCH = 3, 4


def _compute_copy(master: nn.Module, dtype: torch.dtype) -> nn.Module:
    compute = copy.deepcopy(master)
    norms = {id(m) for name, m in compute.named_modules() if is_normalization(name, m)}
    lists = [m for m in compute.modules() if isinstance(m, ParametrizationList)]
    parametrizations = {id(m) for listed in lists for m in listed.modules() if m is not listed}
    for module in compute.modules():
        if id(module) in norms or id(module) in parametrizations:  # fp32 inputs; a norm hands bf16 on
            module.register_forward_pre_hook(
                lambda _, args: tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
            if id(module) in norms:
                module.register_forward_hook(lambda _, __, out: out.to(dtype) if torch.is_tensor(out) else out)
            continue
        if isinstance(module, ParametrizationList):  # the weight made in fp32 from bf16 originals, handed on in bf16
            module.register_forward_hook(lambda _, __, out: out.to(dtype))
        for param in module.parameters(recurse=False):
            param.data = param.data.to(dtype)
        saved = False
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_floating_point():
                continue
            if name in module._non_persistent_buffers_set:
                module._buffers[name] = buffer.to(dtype)
            else:
                saved = True
        if saved:  # the output back in the input's dtype: the activations stay bf16
            module.forward = functools.partial(_under_autocast, module.forward, dtype)
    return compute


def _under_autocast(forward: Callable, dtype: torch.dtype, *args, **kwargs):
    first = next(a.dtype for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point())
    with torch.autocast("cpu", dtype):
        out = forward(*args, **kwargs)
    return out.to(first) if torch.is_tensor(out) and out.is_floating_point() else out


def train_o2_by_hand(
    make: Callable[[], nn.Module], dataset: Dataset, *, batch_size: int, steps: int,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` steps of O2 from ``make()`` (seeded by the caller); returns rank-local losses and the state a
    checkpoint would hold: the master parameters and the compute copy's buffers (running statistics move there)."""
    master = make()
    compute = _compute_copy(master, dtype)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True)
    opt = optimizer(list(master.parameters()))
    pairs = list(zip(master.parameters(), compute.parameters(), strict=True))
    losses: list[float] = []
    for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
        with torch.no_grad():
            for ours, theirs in pairs:
                theirs.copy_(ours)
            for buffer in compute.buffers() if world > 1 else ():  # rank 0's, as DDP broadcasts before a forward
                dist.broadcast(buffer, 0)
        logits = compute(x.to(dtype))  # the model's layers: O2, no autocast
        with torch.autocast("cpu", dtype):  # the step's own code as under DDP's AMP: the loss on bf16 logits in fp32
            loss = F.cross_entropy(logits, y)
        losses.append(loss.item())
        loss.backward()
        for ours, theirs in pairs:
            grad = torch.zeros_like(ours) if theirs.grad is None else theirs.grad.float()
            if world > 1:
                dist.all_reduce(grad)
            ours.grad, theirs.grad = grad / world, None
        opt.step()
        opt.zero_grad()
        if len(losses) == steps:
            break
    state = {k: v.detach().clone() for k, v in master.state_dict().items()}
    state.update({k: v.detach().clone() for k, v in compute.state_dict().items() if k in state and k not in
                  dict(master.named_parameters())})  # saved buffers: running statistics move in the compute copy
    return losses, state


class O2Net(nn.Module):
    """Every rule O2 has here: convolution + BatchNorm (running statistics in fp32), pre-norm blocks with LayerNorm,
    a saved fp32 buffer in a block's compute (its owner under autocast) and an unsaved one (taken in bf16), weight
    parametrizations (``weight_norm`` in every block, ``spectral_norm`` on the head: its power iteration's vectors
    are saved fp32 buffers, updated in place each training forward)."""

    def __init__(self, dim: int = 16, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim, 4, 4), nn.BatchNorm2d(dim))
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = parametrizations.spectral_norm(nn.Linear(dim, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc2 = nn.LayerNorm(dim), nn.Linear(2 * dim, dim)
        self.fc1 = parametrizations.weight_norm(nn.Linear(dim, 2 * dim))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * self.scale + self.shift


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)  # fp32 state on fp32 masters, as O2 keeps it


class _O2Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.losses = O2Net(), []

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return _adamw(list(self.parameters()))


def compare_with_o2_by_hand(trainer: Callable[..., L.Trainer], flag: str) -> dict:
    """Run :func:`train_o2_by_hand` and then ``trainer(precision=flag).fit`` on :class:`O2Net` from seed 0 (the
    fit reuses the process group the hand run made on several ranks); their losses, and the names of the state's
    entries that differ in dtype or value."""
    g, n = torch.Generator().manual_seed(1), 8 * BATCH
    data = TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    by_hand, expected = train_o2_by_hand(O2Net, data, batch_size=BATCH, steps=STEPS, optimizer=_adamw)
    torch.manual_seed(0)
    module = _O2Module()
    trainer(precision=flag, max_steps=STEPS).fit(module, DataLoader(data, batch_size=BATCH))
    different = differing_entries(module.net.state_dict(), expected)
    return {"losses": module.losses, "by_hand": by_hand, "different": different, "compared": len(expected)}


def differing_entries(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``expected``'s entries that ``state`` lacks or holds in another dtype or value."""
    return [k for k, v in expected.items() if k not in state or state[k].dtype != v.dtype
            or not torch.equal(state[k].cpu(), v)]
