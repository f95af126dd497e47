"""Sharpness-aware minimization (Foret et al., 2021) as vision users bring it: the widely copied PyTorch
formulation (an optimizer wrapping a base one, ``first_step`` climbing to ``w + e(w)`` along the gradient scaled to
``rho``, ``second_step`` returning to ``w`` and stepping the base optimizer with the gradient taken there), with a
``step(closure)`` that runs the closure twice, which Lightning's automatic optimization hands it. Written for whole
tensors: the gradient norm over every parameter is what sharding could get wrong."""

from __future__ import annotations

from collections.abc import Callable

import torch


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer: type[torch.optim.Optimizer], rho: float = 0.05, adaptive: bool = False,
                 **kwargs) -> None:
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_((torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        assert closure is not None, "SAM needs the closure: it runs the forward and backward twice"
        closure = torch.enable_grad()(closure)
        loss = closure()
        self.first_step(zero_grad=True)
        closure()
        self.second_step()
        return loss

    def _grad_norm(self) -> torch.Tensor:
        device = self.param_groups[0]["params"][0].device
        return torch.norm(torch.stack([
            ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(device)
            for group in self.param_groups for p in group["params"] if p.grad is not None
        ]), p=2)
