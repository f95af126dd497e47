"""Rank script: ``model.state_dict()`` / ``model.load_state_dict()`` the DDP way, under ``"ddp"`` and VitScaleStrategy.

The DDP run goes first and keeps its state dicts in memory (``ORACLE``); the VitScaleStrategy run compares its own
with them on every rank. Results are keyed ``<scenario>/<strategy>``; one launch, one process group.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, loader, random_images
from tests.helpers.scenarios import rank_zero_alone, run_scenarios

warnings.filterwarnings("ignore")
PROBE = random_images(4, seed=7).tensors[0]
ORACLE: dict[str, dict[str, torch.Tensor]] = {}  # filled by the DDP run
OUT = Path(sys.argv[1])  # run_scenarios writes the results there too


def trainer(name: str, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)),
        strategy=VitScaleStrategy() if name == "vitscale" else "ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def describe(state: dict) -> dict:
    """What a plain script sees: tensor types, devices and dtypes, and the keys."""
    return {
        "keys": list(state),
        "types": sorted({type(v).__name__ for v in state.values()}),
        "devices": sorted({str(v.device) for v in state.values()}),
        "dtypes": {k: str(v.dtype) for k, v in state.items()},
    }


def largest_difference(name: str, state: dict, label: str) -> float:
    """Against DDP's state dict taken at the same point (the DDP run records it and reports 0)."""
    if name == "ddp":
        ORACLE[label] = {k: v.detach().clone() for k, v in state.items()}
        return 0.0
    return difference(state, ORACLE[label])


def difference(state: dict, expected: dict) -> float:
    """Largest absolute difference; infinite where keys differ or a value is not a plain tensor."""
    if list(state) != list(expected) or any(isinstance(v, DTensor) for v in state.values()):
        return float("inf")
    return max(float((v.double() - expected[k].double()).abs().max()) for k, v in state.items())


class TakeStateDicts(Callback):
    """``state_dict()`` from callbacks on every rank (mid-training, then at the end of training)."""

    def __init__(self, name: str) -> None:
        self.name, self.facts = name, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            state = pl_module.state_dict()
            self.facts["mid"] = describe(state)
            self.facts["mid_diff"] = largest_difference(self.name, state, "mid")
            head = pl_module.backbone.head.state_dict()
            self.facts["mid_head"] = describe(head)
            self.facts["mid_head_diff"] = largest_difference(self.name, head, "mid_head")

    def on_train_end(self, trainer, pl_module) -> None:
        self.facts["train_end_diff"] = largest_difference(self.name, pl_module.state_dict(), "train_end")


class LoadAtTestStart(Callback):
    """Loads other weights into the model before ``trainer.test`` runs (plain full tensors, as under DDP)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights, self.outcome = weights, ""

    def on_test_start(self, trainer, pl_module) -> None:
        self.outcome = outcome(lambda: pl_module.load_state_dict(self.weights))


def other_weights(seed: int) -> dict[str, torch.Tensor]:
    L.seed_everything(seed, verbose=False)
    return Classifier("encoder").state_dict()


def outputs(model: torch.nn.Module) -> list[float]:
    model.eval()
    with torch.no_grad():
        return model(PROBE).flatten().tolist()


def outcome(call) -> str:
    """What ``load_state_dict`` returned, or the error it raised."""
    try:
        return str(call())
    except Exception as error:  # noqa: BLE001 - the message is what the scenario records
        return f"{type(error).__name__}: {error}"


def error_of(call) -> str | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what the scenario records
        return f"{type(error).__name__}: {error}"
    return None


def state_dicts(name: str) -> dict:
    L.seed_everything(0, verbose=False)
    model, taker = Classifier("encoder"), TakeStateDicts(name)
    t = trainer(name, max_steps=4, callbacks=[taker])
    t.fit(model, loader(n=32))
    facts = dict(taker.facts, losses=model.losses)

    # After fit: save on rank 0 (every rank calls state_dict), load into a plain model in "another script".
    final = model.state_dict()
    facts["final"] = describe(final)
    facts["final_diff"] = largest_difference(name, final, "final")
    facts["backbone"] = describe(model.backbone.state_dict())
    path = OUT / f"final-{name}.pt"
    if t.is_global_zero:
        torch.save(final, path)
    t.strategy.barrier()
    plain = Classifier("encoder")
    facts["plain_load"] = outcome(lambda: plain.load_state_dict(torch.load(path, weights_only=True)))
    facts["plain_outputs"], facts["outputs"] = outputs(plain), outputs(model)

    # load_state_dict of plain full tensors into the trained model: whole model, a submodule, strict, errors.
    other = other_weights(1)
    facts["load"] = outcome(lambda: model.load_state_dict(other))
    facts["loaded_outputs"] = outputs(model)
    facts["loaded_diff"] = difference(model.state_dict(), other)
    head = {k.removeprefix("backbone.head."): v + 1 for k, v in other.items() if k.startswith("backbone.head.")}
    facts["head_load"] = outcome(lambda: model.backbone.head.load_state_dict(head))
    facts["head_loaded_outputs"] = outputs(model)
    partial = {k: v for k, v in other.items() if k != "backbone.head.bias"}
    facts["non_strict"] = outcome(lambda: model.load_state_dict(partial, strict=False))
    facts["strict_missing_error"] = error_of(lambda: model.load_state_dict(partial))
    wrong = dict(other, **{"backbone.head.weight": torch.zeros(3, 3)})
    facts["shape_error"] = error_of(lambda: model.load_state_dict(wrong))
    facts["unexpected_error"] = error_of(lambda: model.load_state_dict(dict(other, extra=torch.zeros(1))))
    facts["after_errors_outputs"] = outputs(model)

    # Loaded in a callback before trainer.test: the test runs on those weights.
    test_weights = other_weights(2)
    loader_callback = LoadAtTestStart(test_weights)
    t2 = trainer(name, callbacks=[loader_callback], limit_test_batches=2)
    facts["test_acc"] = t2.test(model, loader(n=16), verbose=False)[0]["test_acc"]
    facts["test_load"] = loader_callback.outcome
    facts["test_loaded_diff"] = difference(model.state_dict(), test_weights)
    if name == "vitscale":  # the strategy's own checkpoints stay sharded (DCP shards, one set per rank)
        facts["shards_still_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
        saved = t2.strategy.lightning_module_state_dict()  # what trainer.save_checkpoint hands to DCP
        facts["checkpoint_state_is_sharded"] = all(isinstance(v, DTensor) for v in saved.values())
        t2.save_checkpoint(OUT / "sharded.ckpt")
        facts["checkpoint_is_sharded_folder"] = (OUT / "sharded.ckpt").is_dir()
    return facts


def one_rank_call() -> dict:
    """The DDP habit ``if trainer.is_global_zero: torch.save(model.state_dict(), ...)``: bounded, and says why."""
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    t = trainer("vitscale", max_steps=1)
    t.fit(model, loader(n=8))
    return rank_zero_alone(model.state_dict, timeout=ALONE_TIMEOUT_S)


class CallDuringTraining(Callback):
    """In ``on_train_batch_end`` (``at_start``: ``on_train_batch_start``) of batch 1, each rank in ``calls`` makes its
    call (``calls[rank](pl_module)``) and records what it raised, then trains on; the other ranks go straight on to
    the next step (``at_start``: to batch 1's ``training_step``)."""

    def __init__(self, calls: dict[int, Callable[[L.LightningModule], object]], at_start: bool = False) -> None:
        self.calls, self.facts, self.at_start = calls, {}, at_start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.at_start:
            self._call(trainer, pl_module, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.at_start:
            self._call(trainer, pl_module, batch_idx)

    def _call(self, trainer, pl_module, batch_idx) -> None:
        call = self.calls.get(trainer.global_rank)
        if batch_idx == 1 and call is not None:
            start = time.monotonic()
            self.facts = {"error": error_of(lambda: call(pl_module)), "seconds": time.monotonic() - start}


def call_model(model: L.LightningModule) -> None:
    with torch.no_grad():
        model(PROBE)


def during_training(calls: dict[int, Callable[[L.LightningModule], object]], at_start: bool = False) -> dict:
    """Calls that gather the model on some ranks only, in the middle of training: the main group's timeout
    (MAIN_TIMEOUT_S) is long enough that the ranks that went on wait for the ones that called."""
    L.seed_everything(0, verbose=False)
    model, callback = Classifier("encoder"), CallDuringTraining(calls, at_start)
    strategy = VitScaleStrategy(timeout=timedelta(seconds=MAIN_TIMEOUT_S))
    t = trainer("vitscale", max_steps=4, callbacks=[callback], strategy=strategy)
    start = time.monotonic()
    fit_error = error_of(lambda: t.fit(model, loader(n=32)))
    return dict(callback.facts, fit_error=fit_error, losses=model.losses, fit_seconds=time.monotonic() - start)


class CallAtValidationEnd(Callback):
    """The DDP habit ``if trainer.is_global_zero: torch.save(pl_module.state_dict(), ...)`` in
    ``on_validation_epoch_end`` of the first validation, while the other rank goes on to the epoch's logged metrics
    (``sync_dist``) and ``ModelCheckpoint``'s collectives at ``on_validation_end``."""

    def __init__(self, call: bool = True) -> None:
        self.facts: dict = {}
        self.call = call

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self.call and trainer.global_rank == 0 and not self.facts:
            start = time.monotonic()
            self.facts = {"error": error_of(pl_module.state_dict), "seconds": time.monotonic() - start}


def at_validation_end(call: bool = True, make: Callable[[], Classifier] = lambda: Classifier("encoder"),
                      **strategy_options) -> dict:
    """Training with validation every 2 batches and Lightning's ``ModelCheckpoint`` on (its default, as under DDP)."""
    L.seed_everything(0, verbose=False)
    model, callback = make(), CallAtValidationEnd(call)
    strategy = VitScaleStrategy(timeout=timedelta(seconds=MAIN_TIMEOUT_S), **strategy_options)
    t = trainer("vitscale", max_steps=4, callbacks=[callback, ModelCheckpoint(OUT / f"validation_end{id(model)}")],
                strategy=strategy, limit_val_batches=1, val_check_interval=2, enable_checkpointing=True)
    start = time.monotonic()
    fit_error = error_of(lambda: t.fit(model, loader(n=32), loader(n=8)))
    return dict(callback.facts, **getattr(model, "facts", {}), fit_error=fit_error, losses=model.losses,
                fit_seconds=time.monotonic() - start)


class ExtraCall(Classifier):
    """The DDP habit of calling the model once more inside a step on some ranks (``if trainer.is_global_zero:
    self.logger.log_image(self(images))``): in ``training_step`` of batch 1 or ``validation_step`` of batch 0,
    after the step's own forward, on each rank in ``ranks``; records the outputs, or the error it caught."""

    def __init__(self, ranks: set[int], where: str) -> None:
        super().__init__("encoder")
        self.ranks, self.where, self.facts = ranks, where, {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.where == "training" and batch_idx == 1:
            self._call()
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        if self.where == "validation" and batch_idx == 0 and not self.facts:
            self._call()

    def _call(self) -> None:
        if self.global_rank not in self.ranks:
            return
        start = time.monotonic()
        found: list[float] = []
        with torch.no_grad():
            error = error_of(lambda: found.extend(self(PROBE).flatten().tolist()))
        self.facts = {"error": error, "outputs": found, "seconds": time.monotonic() - start}


def extra_call(name: str, ranks: set[int], **strategy_options) -> dict:
    """An extra call of the model in ``training_step`` on ``ranks`` (``name``: the strategy)."""
    L.seed_everything(0, verbose=False)
    model = ExtraCall(ranks, "training")
    options = dict(strategy=VitScaleStrategy(timeout=timedelta(seconds=MAIN_TIMEOUT_S), **strategy_options))
    t = trainer(name, max_steps=4, **(options if name == "vitscale" else {}))
    fit_error = error_of(lambda: t.fit(model, loader(n=32)))
    return dict(model.facts, fit_error=fit_error, losses=model.losses)


# The strategy's timeout, the handshake's too: a lone call learns within about a second that the other rank went on
# (it waited out the whole timeout before: SIDE_TIMEOUT_S = 1.0 here), and the rank that catches the error rejoins
# the step the other ranks wait in, well within it; the test shows that nothing was sent.
MAIN_TIMEOUT_S = 20.0
# Bounds a call that can never succeed (the other rank joins no collective until it returned): 3 s before.
ALONE_TIMEOUT_S = 1.5
SCENARIOS = {
    "state_dicts/ddp": lambda: state_dicts("ddp"),  # first: the oracle
    "state_dicts/vitscale": lambda: state_dicts("vitscale"),
    "during_training/state_dict": lambda: during_training({0: lambda m: m.state_dict()}),
    "during_training/model_call": lambda: during_training({0: call_model}),
    # At a batch's start: rank 1 is then past Lightning's broadcast that starts each batch, in training_step's
    # collectives, which count the batch (the strategy's training_step)
    "during_training/at_batch_start": lambda: during_training({0: lambda m: m.state_dict()}, at_start=True),
    "during_training/disagree": lambda: during_training({0: lambda m: m.state_dict(), 1: call_model}),
    "during_training/other_module": lambda: during_training(
        {0: lambda m: m.state_dict(), 1: lambda m: m.backbone.head.state_dict()}
    ),
    # Rank 1 then waits in the strategy's collectives (`sync_dist`'s reduce, ModelCheckpoint's), counted as entered
    "during_training/validation_end": at_validation_end,
    "validation_end/no_call": lambda: at_validation_end(call=False),
    # An extra call of the model inside a step on rank 0 only, caught there: every unit resharded (the plan under
    # which the other rank's gloo aborted before the guard), then the default plan (units kept: no gather needed)
    "in_step/training_alone": lambda: extra_call("vitscale", {0}, priority="memory"),
    "in_step/validation_alone": lambda: at_validation_end(False, lambda: ExtraCall({0}, "validation")),
    "in_step/every_rank/ddp": lambda: extra_call("ddp", {0, 1}),
    "in_step/every_rank/vitscale": lambda: extra_call("vitscale", {0, 1}, priority="memory"),
    "one_rank_call/vitscale": one_rank_call,  # last: its timed-out handshake closes the side group
}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
