"""Terms on the parameters that a ``training_step`` adds to its loss, as people write them under DDP
(``sharding/whole_terms.py``): shared by the one-device unit tests and the 2-rank scenarios.

``PenaltyModel(term, where)``: the zoo's hand-written ViT (2 blocks) trained by SGD, its loss plus ``term``:

- ``"l2"``: ``1e-2 * sum(p.pow(2).sum() for p in self.parameters())``;
- ``"l2sp"``: L2-SP, the distance to plain starting weights saved at ``__init__`` (shifted: a gradient from step 1);
- ``"ortho"``: an orthogonality penalty on each block's ``qkv`` weight, ``(W W^T - I)^2``;
- ``"data"``: a block weight applied to this rank's batch outside the forward (its gradient differs per rank:
  averaged as DDP averages it; under ``bf16-mixed`` the fp32 batch meets the block's gathered bf16 weight, which
  the step's autocast computes in bf16 as DDP's AMP does: ``precision/step_autocast.py``);
- ``"features"``: the same weight applied to the model's output features (bf16 under O2: the whole fp32 weight meets
  bf16 data);
- ``"gnorm"``: gradient-norm regularization, the squared norm of ``torch.autograd.grad(loss, params,
  create_graph=True)`` (on lucidrains' ViT: SDPA has no double backward on CPU);
- ``"probe"``: ``torch.autograd.grad(loss, params, retain_graph=True)`` read, not trained on (a multi-task method
  weighting its losses by their gradients): this rank's squared gradient norm kept in ``probed``;

taken ``"before"`` or ``"after"`` the forward. ``PENALTY_CASES``: ``<term>-<where>[-bf16 | -accumulated]`` (under
``bf16-mixed``; two micro-batches a step).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.helpers.tiny_vit_module import TinyViTModule
from tests.helpers.zoo import LucidViT

PENALTY_CASES = ["l2-before", "l2-after", "l2sp-after", "ortho-before", "data-before", "l2-before-accumulated",
                 "gnorm-after", "probe-after", "l2-before-bf16", "features-after-bf16", "probe-after-bf16",
                 "data-after-bf16"]


class PenaltyModel(TinyViTModule):
    def __init__(self, term: str, where: str) -> None:
        super().__init__()
        if term == "gnorm":
            torch.manual_seed(0)
            self.net = LucidViT()
        self.start = {name: p.detach().clone() + 0.01 for name, p in self.net.named_parameters()}  # plain tensors
        self.term, self.where = term, where
        self.probed: list[float] = []

    def penalty(self, x: torch.Tensor, features: torch.Tensor | None, loss: torch.Tensor | None = None) -> torch.Tensor:
        if self.term in ("gnorm", "probe"):
            assert loss is not None
            params = [p for p in self.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, create_graph=self.term == "gnorm", retain_graph=True)
            squares = sum(g.float().pow(2).sum() for g in grads)
            if self.term == "gnorm":
                return 1e-2 * squares
            self.probed.append(float(squares))
            return torch.zeros((), device=x.device)
        if self.term == "l2":
            return 1e-2 * sum(p.pow(2).sum() for p in self.parameters())
        if self.term == "l2sp":
            return 1e-1 * sum((p - self.start[name]).pow(2).sum() for name, p in self.net.named_parameters())
        if self.term == "ortho":
            total = 0
            for layer in self.net.layers:
                gram = layer.attn.qkv.weight @ layer.attn.qkv.weight.T
                total = total + (gram - torch.eye(gram.shape[0], device=x.device)).pow(2).sum()
            return 1e-3 * total
        weight = self.net.layers[0].fc1.weight
        if self.term == "features":
            assert features is not None
            return 1e-2 * (features[:, :1].expand(-1, weight.shape[1]) @ weight.T).pow(2).mean()
        return 1e-2 * (x.flatten(1)[:, : weight.shape[1]] @ weight.T).pow(2).mean()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.where == "before":
            term = self.penalty(x, None)
            loss = F.cross_entropy(self.net(x), y) + term
        else:
            logits = self.net(x)
            loss = F.cross_entropy(logits, y)
            loss = loss + self.penalty(x, logits, loss)
        self.losses.append(loss.item())
        return loss

    def whole_weights(self) -> dict[str, list[float]]:
        """Each parameter's whole values (a collective on several ranks: every rank calls it)."""
        state = self.state_dict()
        return {name: (value.full_tensor() if isinstance(value, DTensor) else value).flatten().tolist()
                for name, value in state.items()}


def fit_penalty(case: str, strategy, devices: int = 1, accelerator: str = "cpu", **trainer) -> PenaltyModel:
    term, where, *variant = case.split("-")
    model = PenaltyModel(term, where)
    L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=4, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              precision="bf16-mixed" if variant == ["bf16"] else "32-true",
              accumulate_grad_batches=2 if variant == ["accumulated"] else 1, **trainer).fit(model)
    return model
