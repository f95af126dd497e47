"""Rank script for the block zoo (tests/helpers/zoo.py): ``zoo.py OUT name,...``.

Each family through ``Trainer.fit`` for 3 steps from the same seed and data at a global batch of 8 (2 data-parallel
ranks of 4): on 2 CPU ranks ``strategy="ddp"`` and ``VitScaleStrategy()``; on 4, ``VitScaleStrategy(tensor_parallel=2)``
(TP=2 x FSDP=2), whose refusal at setup is recorded with its message. On 2 CPU ranks ``layout`` also trains
lucidrains' ``ModuleList([attention, feed-forward])`` layout for 6 steps under DDP and under ``VitScaleStrategy()``:
by default, with every block checkpointed (one unit per layer), built in ``configure_model()``, and with each layer
an ``nn.Sequential`` the parent iterates (found from the modules the setup's fake-tensor step called), then calls
the backbone outside a step; ``reused`` a block every layer shares, ``two_pass`` a backbone run twice a step (each
with the reduce-scatters its fit sent). Writes ``rank{r}.json``: losses, refusals, setup summaries, what became of
the layers.
"""

from __future__ import annotations

import functools
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.discovery.tensor_plan import TensorPlanError
from lightning_vitscale.sharding.activation_checkpointing import checkpoint_mode
from tests.helpers.recording import count_collectives
from tests.helpers.scenarios import run_scenarios
from tests.helpers.units import planned_units, units_made
from tests.helpers.zoo import (
    APART,
    CLASSES,
    FAMILIES,
    FOURIER,
    IMAGE,
    INTERLEAVED,
    PARTS,
    Block,
    DinoHeadViT,
    FourierOperator,
    LucidViT,
    SelfCheckpointedViT,
    SharedBlockViT,
    TwoPassViT,
)

warnings.filterwarnings("ignore")
GLOBAL_BATCH = 8
DDP = "ddp_find_unused_parameters_true"  # a family may hold parameters its classification does not use


class Model(L.LightningModule):
    """``family`` (tests/helpers/zoo.py), or a ``LucidViT`` with ``container`` layers; built in ``configure_model()``
    with ``configured``."""

    def __init__(self, family: str, container: type[nn.Module] = nn.ModuleList, configured: bool = False) -> None:
        super().__init__()
        self.family, self.container = family, container
        torch.manual_seed(0)  # every strategy's run starts from the same weights
        self.backbone = None if configured else self.build()
        self.losses: list[float] = []

    def build(self) -> nn.Module:
        if self.family.startswith("shared"):
            return SharedBlockViT(listed=self.family == "shared_listed")
        if self.family == "two_pass":
            return TwoPassViT()
        if self.family.startswith("self_checkpointed"):
            return SelfCheckpointedViT(self.family.split(":")[1])
        if self.family == "dino_head":
            return DinoHeadViT()
        if self.family in FOURIER:
            return FOURIER[self.family]()
        if self.family == "fno":
            return FourierOperator()
        if self.family in PARTS:
            return PARTS[self.family][0]()
        if self.family in APART:
            return APART[self.family]()
        if self.family in INTERLEAVED:
            return INTERLEAVED[self.family]()
        return FAMILIES[self.family]() if self.family != "lucid" else LucidViT(container=self.container)

    def configure_model(self) -> None:
        if self.backbone is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # the weights the __init__-built model starts from
                self.backbone = self.build()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(batch_size: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH * steps
    images, labels = torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=False)


def fit(model: Model, strategy, data_parallel: int, steps: int, precision: str = "32-true",
        accumulate: int = 1) -> tuple[dict, L.Trainer]:
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                        precision=precision, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=accumulate)
    try:
        trainer.fit(model, data(GLOBAL_BATCH // data_parallel // accumulate, steps * accumulate))
    except TensorPlanError as error:
        return {"refused": str(error), "losses": model.losses}, trainer
    facts = {"losses": model.losses}
    if isinstance(strategy, VitScaleStrategy):
        facts["summary"] = trainer.strategy.plan.summary()
    return facts, trainer


# The fix a refusal names: a plan of the user's own, here the MLP only (its attention then stays whole, as it says).
USER_PLANS = {"torchvision_vit": {"mlp.0": ColwiseParallel(), "mlp.3": RowwiseParallel()}}


def family(name: str) -> dict:
    """On 2 ranks DDP and ``VitScaleStrategy()``, then under ``bf16-mixed`` DDP (AMP O1) and the recipe (O2,
    ``priority="memory"``); on 4, ``tensor_parallel=2`` (2 data-parallel ranks, as DDP's 2)."""
    if WORLD == 2:
        bf16 = "bf16-mixed"
        return {"ddp": fit(Model(name), DDP, 2, 3)[0], "fsdp": fit(Model(name), VitScaleStrategy(), 2, 3)[0],
                "ddp_bf16": fit(Model(name), DDP, 2, 3, bf16)[0],
                "recipe_bf16": fit(Model(name), VitScaleStrategy(priority="memory"), 2, 3, bf16)[0]}
    found = {"tp2": fit(Model(name), VitScaleStrategy(tensor_parallel=2), 2, 3)[0]}
    if name in USER_PLANS:
        found["tp2_plan"] = fit(Model(name), VitScaleStrategy(tensor_parallel=2, tensor_plan=USER_PLANS[name]), 2, 3)[0]
    return found


def layout() -> dict:
    """Six steps each; after the fit the backbone is called outside a step, as a callback or user would."""
    runs = {
        "ddp": (Model("lucid"), DDP),
        "default": (Model("lucid"), VitScaleStrategy()),
        "checkpointed": (Model("lucid"), VitScaleStrategy(activation_checkpointing=True, blocks_per_unit=1)),
        "configured": (Model("lucid", configured=True), VitScaleStrategy()),
        "sequential": (Model("lucid", container=nn.Sequential), VitScaleStrategy()),
    }
    probe = torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    found = {}
    for name, (model, strategy) in runs.items():
        facts, trainer = fit(model, strategy, 2, 6)
        with torch.no_grad():
            facts["outside"] = model.backbone(probe).sum().item()
        parts = [m for n, m in model.backbone.named_modules() if n.count(".") == 2 and n.startswith("layers.")]
        facts["units"] = [isinstance(m, FSDPModule) for m in parts]
        facts["checkpointed"] = [checkpoint_mode(m) for m in parts]
        facts["fsdp_units"] = trainer.strategy.plan.units if strategy != DDP else 0
        found[name] = facts
    return found


def reused() -> dict:
    """One block every layer shares (``SharedBlockViT``, called 4 times a step), alone and held 4 times in a
    ``ModuleList``: DDP; ``VitScaleStrategy(activation_checkpointing=True)`` as it comes (no repeated block: its
    warning and note); and with the fix they name, ``blocks={Block}``: the block its own unit, resharded after each
    call and checkpointed at each."""
    found = {}
    for family in ("shared", "shared_listed"):
        runs = {"ddp": DDP, "asked": VitScaleStrategy(activation_checkpointing=True),
                "named": VitScaleStrategy(blocks={Block}, activation_checkpointing=True, reshard_after_forward=True)}
        for name, strategy in runs.items():
            model = Model(family)
            with warnings.catch_warnings(record=True) as caught, count_collectives() as sent:
                warnings.simplefilter("always")
                facts, trainer = fit(model, strategy, 2, 4)
            facts["reduce_scatters"] = sent["all_to_all_single"]  # CPU ranks reduce-scatter by all-to-all
            facts["fsdp_units"] = trainer.strategy.plan.units if strategy != DDP else 0
            facts["warnings"] = [str(w.message) for w in caught if "VitScaleStrategy(" in str(w.message)]
            facts["units"] = [n for n, m in model.backbone.named_modules() if isinstance(m, FSDPModule)]
            facts["checkpointed"] = [checkpoint_mode(m) for m in model.backbone.modules() if isinstance(m, Block)]
            found[f"{family}:{name}"] = facts
    return found


def two_pass() -> dict:
    """A backbone run twice a step (``TwoPassViT``), DDP against ``VitScaleStrategy()`` and a unit per block (also
    accumulating 2 micro-batches a step): the reduce-scatters each step sends (each unit once a step, not once a
    pass)."""
    found = {}
    def per_block() -> VitScaleStrategy:
        return VitScaleStrategy(blocks_per_unit=1, reshard_after_forward=True)

    runs = {"ddp": (DDP, 1), "default": (VitScaleStrategy(), 1), "per_block": (per_block(), 1),
            "ddp_acc2": (DDP, 2), "per_block_acc2": (per_block(), 2)}
    for name, (strategy, accumulate) in runs.items():
        with count_collectives() as sent:
            facts, trainer = fit(Model("two_pass"), strategy, 2, 4, accumulate=accumulate)
        facts["reduce_scatters"] = sent["all_to_all_single"]
        facts["fsdp_units"] = trainer.strategy.plan.units if strategy != DDP else 0
        found[name] = facts
    return found


def _count_run(model: L.LightningModule, runs: list[int], *unused) -> None:
    runs.append(model.global_step)


def self_checkpointed() -> dict:
    """Blocks the model's forward checkpoints itself (``SelfCheckpointedViT``: reentrant or not, or a reentrant
    ``checkpoint_sequential``): DDP, the default
    and the recipe's unit per block with its own checkpointing on top (``priority="memory"``). DDP without
    ``find_unused_parameters``: with it, DDP refuses a reentrant checkpoint ("Expected to mark a variable ready
    only once")."""
    found = {}
    for family in ("self_checkpointed:reentrant", "self_checkpointed:non_reentrant", "self_checkpointed:sequential"):
        runs = {"ddp": "ddp", "default": VitScaleStrategy(), "memory": VitScaleStrategy(priority="memory")}
        for name, strategy in runs.items():
            model, runs_of_block = Model(family), []  # the second block's forward runs, by step (first segment's)
            model.backbone.layers[1].fc1.register_forward_pre_hook(
                functools.partial(_count_run, model, runs_of_block))
            try:
                facts = fit(model, strategy, 2, 3)[0]
            except Exception as error:  # noqa: BLE001 - the failure is what the test reads
                facts = {"error": f"{type(error).__name__}: {error}"[:500], "losses": []}
            found[f"{family}:{name}"] = {**facts, "block_runs": [runs_of_block.count(step) for step in range(3)]}
    return found


WORLD = 4  # set from the launch in main


def parts() -> dict:
    """Blocks made of repeated parts (``PARTS``): DDP, ``VitScaleStrategy()`` and the recipe's unit per block
    (``priority="memory"``), with the blocks each found."""
    found = {}
    for family in PARTS:
        runs = {"ddp": DDP, "default": VitScaleStrategy(), "memory": VitScaleStrategy(priority="memory")}
        for name, strategy in runs.items():
            facts, trainer = fit(Model(family), strategy, 2, 3)
            facts["fsdp_units"] = trainer.strategy.plan.units if strategy != DDP else 0
            found[f"{family}:{name}"] = facts
    return found


def apart() -> dict:
    """Blocks of different containers that run apart (``APART``): DDP, ``VitScaleStrategy()`` (the step cannot be
    measured: the recipe's plan) and two blocks a unit pinned with every block checkpointed; the losses, or the error
    a run raised."""
    found = {}
    for family in APART:
        runs = {"ddp": DDP, "default": VitScaleStrategy(),
                "pinned": VitScaleStrategy(blocks_per_unit=2, activation_checkpointing=True)}
        for name, strategy in runs.items():
            try:
                facts, trainer = fit(Model(family), strategy, 2, 3)
                facts["fsdp_units"] = trainer.strategy.plan.units if strategy != DDP else 0
            except Exception as error:  # noqa: BLE001 - the failure is what the test reads
                facts = {"error": f"{type(error).__name__}: {error}"[:500], "losses": []}
            found[f"{family}:{name}"] = facts
    return found


def interleaved() -> dict:
    """Blocks the step calls in another order than the model lists them (``INTERLEAVED``): DDP, ``VitScaleStrategy()``
    and 4 blocks a unit pinned, resharded after forward; the losses, the units made and the planned ones."""
    found = {}
    for family in INTERLEAVED:
        runs = {"ddp": DDP, "default": VitScaleStrategy(),
                "pinned": VitScaleStrategy(blocks_per_unit=4, reshard_after_forward=True)}
        for name, strategy in runs.items():
            model = Model(family)
            facts, trainer = fit(model, strategy, 2, 3)
            if strategy != DDP:
                planned, planned_kept, _ = planned_units(trainer)
                made, kept = units_made(model, [block for unit in planned for block in unit])
                facts.update(planned=planned, planned_kept=planned_kept, made=made, kept=kept,
                             fsdp_units=trainer.strategy.plan.units)
            found[f"{family}:{name}"] = facts
    return found


class DinoModel(Model):
    """DINO's habit on its head: the last layer's gradients dropped (``p.grad = None``) in the first steps."""

    def on_after_backward(self) -> None:
        if self.global_step < 2:
            for param in self.backbone.last_layer.parameters():
                param.grad = None


def parametrized() -> dict:
    """``DinoHeadViT`` (weight parametrizations, old and new API, in the units and outside) for 4 steps: fp32 under
    DDP, ``VitScaleStrategy()`` and the recipe's plan; ``bf16-mixed`` under DDP (AMP O1) and both plans (O2). The
    losses, each parameter's sum after fit, the summary."""
    runs = {"ddp": (DDP, "32-true"), "default": (VitScaleStrategy(), "32-true"),
            "memory": (VitScaleStrategy(priority="memory"), "32-true"), "ddp_bf16": (DDP, "bf16-mixed"),
            "default_bf16": (VitScaleStrategy(), "bf16-mixed"),
            "memory_bf16": (VitScaleStrategy(priority="memory"), "bf16-mixed")}
    found = {}
    for name, (strategy, precision) in runs.items():
        model = DinoModel("dino_head")
        facts, _ = fit(model, strategy, 2, 4, precision)
        with torch.no_grad():
            facts["sums"] = {key: value.float().sum().item() for key, value in model.backbone.state_dict().items()}
        found[name] = facts
    return found


def fourier() -> dict:
    """Fourier token mixers (``FOURIER``: GFNet, AFNO), 3 steps: fp32 under DDP and ``VitScaleStrategy()``,
    ``bf16-mixed`` under DDP (AMP O1) and both plans; the losses and the summary."""
    runs = {"ddp": (DDP, "32-true"), "default": ({}, "32-true"), "ddp_bf16": (DDP, "bf16-mixed"),
            "default_bf16": ({}, "bf16-mixed"), "memory_bf16": ({"priority": "memory"}, "bf16-mixed")}
    return {f"{family}:{name}": fit(Model(family), strategy if strategy == DDP else VitScaleStrategy(**strategy), 2, 3,
                                    precision)[0]
            for family in FOURIER for name, (strategy, precision) in runs.items()}


def complex_weights() -> dict:
    """A Fourier neural operator (complex weights, ``FourierOperator``): under DDP and ``VitScaleStrategy()``, fp32
    with gradients clipped for 2 steps, saved with ``trainer.save_checkpoint`` and resumed from it for 2 more; then
    ``bf16-mixed`` (DDP's AMP O1, the recipe's O2) for 3. The losses, and each complex weight's sum of magnitudes
    after the resumed fit."""
    import sys
    from pathlib import Path

    found = {}
    for name in ("ddp", "default"):
        path = str(Path(sys.argv[1]) / f"fno_{name}.ckpt")
        make = lambda name=name: DDP if name == "ddp" else VitScaleStrategy()  # noqa: E731
        first, second = Model("fno"), Model("fno")
        kwargs = dict(accelerator="cpu", devices=WORLD, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5)
        trainer = L.Trainer(strategy=make(), max_steps=2, **kwargs)
        trainer.fit(first, data(GLOBAL_BATCH // 2, 4))
        trainer.save_checkpoint(path)
        resumed = L.Trainer(strategy=make(), max_steps=4, **kwargs)
        resumed.fit(second, data(GLOBAL_BATCH // 2, 4), ckpt_path=path)
        with torch.no_grad():
            sums = {key: value.abs().sum().item() for key, value in second.backbone.state_dict().items()
                    if value.is_complex()}
        found[name] = {"losses": first.losses + second.losses, "sums": sums}
        if name == "default":
            found[name]["summary"] = trainer.strategy.plan.summary()
    found["ddp_bf16"] = fit(Model("fno"), DDP, 2, 3, "bf16-mixed")[0]
    found["default_bf16"] = fit(Model("fno"), VitScaleStrategy(), 2, 3, "bf16-mixed")[0]
    return found


def scenarios() -> dict:
    families = {name: (lambda name=name: family(name)) for name in FAMILIES}
    return {"layout": layout, "reused": reused, "two_pass": two_pass, "self_checkpointed": self_checkpointed,
            "parts": parts, "apart": apart,
            "interleaved": interleaved,
            "parametrized": parametrized, "fourier": fourier, "complex_weights": complex_weights, **families}


if __name__ == "__main__":
    import os

    WORLD = int(os.environ["WORLD_SIZE"])
    run_scenarios(scenarios())
