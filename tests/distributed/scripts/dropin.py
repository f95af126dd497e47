"""Rank script: what DDP users do outside ``*_step``, each scenario run under ``"ddp"`` and VitScaleStrategy.

Calls from callbacks and after ``fit``, a ``torch.compile``d LightningModule, Lightning's weight-averaging
callbacks and ``sync_batchnorm=True``, and in a step embeddings gathered across ranks with their gradients
(``tests/helpers/collective_habits.py``); results are keyed ``<scenario>/<strategy>`` and the test compares them.
One launch for both strategies: the process group is made once.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_avg_fn

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.kernels.compile import is_compiled
from tests.helpers.models import Classifier, loader, random_images
from tests.helpers.scenarios import rank_zero_alone, run_scenarios, under_each_strategy

warnings.filterwarnings("ignore")
STRATEGY = "vitscale"  # set for each run (`under_each_strategy`)
PROBE = random_images(4, seed=7).tensors[0]
TOKENS = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(3))  # what a block of the encoder takes


def strategy(**kwargs):
    return VitScaleStrategy(**kwargs) if STRATEGY == "vitscale" else "ddp"


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)), strategy=strategy(), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def sharded_or_plain(model: torch.nn.Module) -> bool:
    """Under VitScaleStrategy: every parameter is a DTensor again (nothing left gathered). Under DDP: True."""
    return STRATEGY == "ddp" or all(isinstance(p, DTensor) for p in model.parameters())


def values(t: torch.Tensor) -> list[float]:
    return t.detach().float().flatten().tolist()


class Probe(Callback):
    """Calls the model the ways DDP users do from callbacks."""

    def __init__(self) -> None:
        self.facts: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:  # gradients on, with a backward, in the middle of training
            pl_module.eval()
            out = pl_module(PROBE)
            out.sum().backward()
            pl_module.train()
            self.facts["batch_end_grad"] = values(out)
        if batch_idx == 3:  # after the update: a copy gathered in on_after_backward must not be used
            pl_module.eval()
            with torch.no_grad():
                self.facts["after_update"] = values(pl_module(PROBE))
            pl_module.train()
        if batch_idx == 2:  # timm's ModelEmaV3(pl_module.backbone): a deep copy of a child
            self.facts["deepcopy_child"] = plain_copy_output(copy.deepcopy(pl_module.backbone))
        if batch_idx == 2:  # the common case: no_grad, a child module
            pl_module.eval()
            with torch.no_grad():
                self.facts["batch_end_child"] = values(pl_module.backbone(PROBE))
            pl_module.train()
            self.facts["nothing_gathered_after_no_grad_call"] = sharded_or_plain(pl_module)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == 4:  # mid-step: the modules hold gathered (not sharded) weights
            self.facts["deepcopy_in_step"] = plain_copy_output(copy.deepcopy(pl_module))

    def on_after_backward(self, trainer, pl_module) -> None:
        # Gradients on, no backward: the gathered copy is kept; the update then makes it stale.
        if trainer.fit_loop.epoch_loop.batch_idx == 3:
            self.facts["after_backward"] = values(pl_module.backbone.head(torch.ones(2, 64)))

    def on_train_end(self, trainer, pl_module) -> None:
        pl_module.eval()
        with torch.no_grad():
            self.facts["train_end"] = values(pl_module(PROBE))
        self.facts["train_end_grad_enabled"] = values(pl_module.backbone(PROBE))

    def on_fit_end(self, trainer, pl_module) -> None:
        with torch.no_grad():
            self.facts["fit_end"] = values(pl_module(PROBE))


def plain_copy_output(twin: torch.nn.Module) -> list[float]:
    """The copy's output on PROBE, after checking it is DDP's kind of copy: plain parameters, no hooks."""
    assert not any(isinstance(p, DTensor) for p in twin.parameters()), "a deep copy holds DTensors"
    assert not any(len(hooks) for m in twin.modules() for name, hooks in vars(m).items() if name.endswith("_hooks")
                   and isinstance(hooks, dict)), "a deep copy kept hooks"
    twin.eval()
    with torch.no_grad():
        return values(twin(PROBE))


def outside_steps() -> dict:
    L.seed_everything(0, verbose=False)
    model, probe = Classifier("encoder"), Probe()
    t = trainer(max_steps=6, callbacks=[probe])
    t.fit(model, loader(n=48))
    facts = dict(probe.facts, losses=model.losses)
    model.eval()
    with torch.no_grad():  # the user's script after fit returns, on every rank
        facts["after_fit"] = values(model(PROBE))
    out = model(PROBE)
    out.sum().backward()
    grad = model.backbone.head.weight.grad  # FSDP reduces it as in a step: sharded, averaged over ranks
    facts["after_fit_grad"] = values(grad.full_tensor() if isinstance(grad, DTensor) else grad)
    facts["deepcopy_after_fit"] = plain_copy_output(copy.deepcopy(model))
    t.limit_val_batches = 2
    facts["val_after"] = t.validate(model, loader(n=16), verbose=False)[0]["val_loss"]
    facts["nothing_gathered_after_validate"] = sharded_or_plain(model)
    return facts


class EarlyProbe(Callback):
    """Calls the model, a child and a block unit in each stage's ``on_*_start``, before any step (issue 21.6)."""

    def __init__(self, block_first: bool) -> None:
        self.block_first = block_first
        self.facts: dict = {}

    def _probe(self, stage: str, pl_module) -> None:
        training = pl_module.training
        pl_module.eval()
        block = pl_module.backbone.encoder.layers[0]  # a block unit of its own (FSDP), called directly
        calls = {"block": lambda: block(TOKENS), "model": lambda: pl_module(PROBE)}
        with torch.no_grad():
            for name in sorted(calls, reverse=self.block_first):  # "model" first, or "block" first
                self.facts[f"{stage}_{name}"] = values(calls[name]())
        self.facts[f"{stage}_child"] = values(pl_module.backbone.head(torch.ones(2, 64)))  # gradients on if allowed
        pl_module.train(training)

    def on_train_start(self, trainer, pl_module) -> None:
        self._probe("fit", pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._probe("validate", pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._probe("test", pl_module)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._probe("predict", pl_module)


def before_first_step() -> dict:
    """Each stage on a fresh model whose first call comes from a hook before the first step: DDP's outputs, and
    the stage itself (training losses, validation loss, test metric, predictions) unaffected."""
    facts: dict = {}
    for i, stage in enumerate(("fit", "validate", "test", "predict")):
        L.seed_everything(0, verbose=False)
        model, probe = Classifier("encoder"), EarlyProbe(block_first=i % 2 == 0)
        t = trainer(max_steps=2, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1, callbacks=[probe])
        if stage == "fit":
            t.fit(model, loader(n=16))
            facts["fit_losses"] = model.losses
        elif stage == "predict":
            facts["predictions"] = [float(v) for batch in t.predict(model, loader(n=8)) for v in batch]
        else:
            facts[f"{stage}_metrics"] = list(getattr(t, stage)(model, loader(n=8), verbose=False)[0].values())
        facts.update(probe.facts)
    return facts


def compiled() -> dict:
    """``fit(torch.compile(model))`` under VitScaleStrategy against the plain model under DDP: compiling must not
    change the losses. Dropout off: compiled dropout draws its random numbers differently from eager."""
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0
    t = trainer(max_steps=3)
    t.fit(torch.compile(model, backend="eager") if STRATEGY == "vitscale" else model, loader(n=24))
    facts: dict = {"losses": model.losses}
    if STRATEGY == "vitscale":
        blocks = [model.get_submodule(name) for name in t.strategy.plan.block_names]
        facts["compiled_blocks"] = t.strategy.plan.kernels["compiled blocks"]
        facts["blocks_compiled"] = all(is_compiled(b) for b in blocks)
        facts["step_not_compiled"] = model._compiler_ctx is None
    return facts


def weight_averaging() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    averaging = WeightAveraging(avg_fn=get_ema_avg_fn(0.8))
    t = trainer(max_steps=4, callbacks=[averaging], limit_val_batches=2, val_check_interval=2)
    return _fit_and_read(t, model, averaging_is_sharded=lambda: averaging._average_model.module)


def stochastic_weight_averaging() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)
    t = trainer(max_epochs=3, limit_train_batches=2, callbacks=[swa])
    return _fit_and_read(t, model, averaging_is_sharded=lambda: swa._average_model)


def _fit_and_read(t: L.Trainer, model: Classifier, averaging_is_sharded) -> dict:
    try:
        t.fit(model, loader(n=32), loader(n=16))
    except Exception as error:  # noqa: BLE001 - the refusal is what this scenario records
        return {"error": f"{type(error).__name__}: {error}"}
    model.eval()
    with torch.no_grad():
        out = model(PROBE)
    return {
        "losses": model.losses,
        "val_losses": model.val_losses,
        "averaged_out": values(out),
        "averaged_copy_sharded": sharded_or_plain(averaging_is_sharded()),
    }


def sync_batchnorm() -> dict:
    """On CPU both refuse: DDP at the first forward (torch's check), VitScaleStrategy at setup (before any step)."""
    L.seed_everything(0, verbose=False)
    model = Classifier("resnet")
    t = trainer(max_steps=2, sync_batchnorm=True)
    try:
        t.fit(model, loader(n=16))
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {error}", "steps_run": len(model.losses)}
    return {"error": None, "steps_run": len(model.losses)}


class NormLogging(Classifier):
    """Logs each step's gradient norms in ``on_before_optimizer_step``, as Lightning's docs of that hook show, with
    Lightning's ``grad_norm`` under DDP and ``lightning_vitscale.grad_norm`` (the same call) under VitScaleStrategy;
    ``lightning``: Lightning's under both, which VitScaleStrategy refuses naming the fix."""

    lightning = False

    def on_before_optimizer_step(self, optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm as lightnings

        from lightning_vitscale import grad_norm as ours

        norms = (lightnings if STRATEGY == "ddp" or self.lightning else ours)(self.backbone, norm_type=2)
        self.norms = getattr(self, "norms", []) + [{key: float(value) for key, value in norms.items()}]
        self.log_dict(norms)


def gradient_norms() -> dict:
    """Each parameter's gradient norm and the total, every step; under VitScaleStrategy also Lightning's own call."""
    found = {}
    for lightning in (False, True):
        L.seed_everything(0, verbose=False)
        model = NormLogging("encoder")
        model.lightning = lightning
        try:
            trainer(max_steps=3).fit(model, loader(n=32))
        except RuntimeError as error:
            found["lightning_error" if lightning else "error"] = str(error)
            continue
        found["lightning_norms" if lightning else "norms"] = model.norms
    return found


class ScalarReads(Classifier):
    """Numbers read from the parameters and gradients as DDP users do, each step in ``on_before_optimizer_step``:
    ``.item()`` of each gradient's norm, ``float()`` of each weight's largest magnitude, a sum of squares over the
    gradients and ``bool()`` of a test on it, the infinity norms of ``grad_norm`` (Lightning's under DDP); and a
    learnable one-element temperature (a ``[1]`` tensor: one rank's shard holds it) read with ``.item()`` in the step
    and ``float()`` after fit."""

    def __init__(self) -> None:
        super().__init__("encoder")
        self.temperature = torch.nn.Parameter(torch.full((1,), 1.5))
        self.reads: list[list[float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x) / self.temperature

    def on_before_optimizer_step(self, optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm as lightnings

        from lightning_vitscale import grad_norm as ours

        grads = [p.grad for p in self.parameters() if p.grad is not None]
        total = sum(g.pow(2).sum() for g in grads)
        infinity = (lightnings if STRATEGY == "ddp" else ours)(self, norm_type="inf")  # max |g|: empty shards too
        # logged as they are: Lightning reads them for its logger, on every rank, and its progress bar, on rank 0
        self.log("first_grad_norm", grads[0].norm(), prog_bar=True)
        self.log("temperature_max", self.temperature.abs().max(), prog_bar=True)
        self.log("grad_sum", sum(g.sum() for g in grads), on_epoch=True)
        self.reads.append([g.norm().item() for g in grads] + [float(p.detach().abs().max()) for p in self.parameters()]
                          + [total.item(), float(bool(total > 0)), self.temperature.item()]
                          + [float(infinity[key]) for key in sorted(infinity)])


def scalar_reads() -> dict:
    """DDP's numbers from ``.item()`` / ``float()`` / ``bool()`` of sharded tensors in a step and after fit."""
    L.seed_everything(0, verbose=False)
    model = ScalarReads()
    logger = CSVLogger(os.path.join(sys.argv[1], f"scalar_reads_{STRATEGY}"))
    t = trainer(max_steps=3, logger=logger, log_every_n_steps=1, enable_progress_bar=True)
    t.fit(model, loader(n=16))
    after = [float(p.detach().sum()) for p in model.parameters()] + [float(model.temperature)]
    logged = {name: float(value) for name, value in sorted(t.callback_metrics.items())}
    return {"reads": model.reads, "after_fit": after, "losses": model.losses, "logged": logged}


class LoggedOnRankZero(ScalarReads):
    """Logs a sharded weight's largest magnitude with ``rank_zero_only=True``, on every rank (Lightning's docs of the
    flag: the value is rank 0's); its number needs every rank's part."""

    def on_before_optimizer_step(self, optimizer) -> None:
        self.log("weight_max", next(self.backbone.parameters()).abs().max(), rank_zero_only=True)


def logged_rank_zero_only() -> dict:
    """``self.log(..., rank_zero_only=True)`` of a sharded tensor's number through ``Trainer.fit``: refused in the
    first step on every rank, at once (no communication: rank 0 alone would be refused the same), naming the fix."""
    L.seed_everything(0, verbose=False)
    model = LoggedOnRankZero()
    start = time.monotonic()
    try:
        trainer(max_steps=2).fit(model, loader(n=16))
    except Exception as error:  # noqa: BLE001 - the refusal is what the test reads
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start,
                "losses": len(model.losses)}
    return {"error": None, "losses": len(model.losses)}


def one_rank_scalar_read() -> dict:
    """Only rank 0 reads a sharded weight's number after fit: it fails within the timeout, naming the fix, and sends
    nothing the other ranks' next collective could meet."""
    L.seed_everything(0, verbose=False)
    model = ScalarReads()
    trainer(max_steps=1).fit(model, loader(n=8))
    weight = next(model.backbone.parameters()).detach()
    return rank_zero_alone(lambda: float(weight.abs().max()), timeout=1.5)


class FineTuned(L.LightningModule):
    """A backbone and a head, the backbone frozen by ``BackboneFinetuning`` before setup and unfrozen at epoch 1
    (its parameters then join the optimizer as a param group of their own), as Lightning's docs of it show."""

    def __init__(self) -> None:
        super().__init__()
        from tests.helpers.models import CLASSES, EncoderClassifier

        torch.manual_seed(0)
        self.backbone, self.head = EncoderClassifier(dropout=0.0), torch.nn.Linear(CLASSES, CLASSES)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.head(self.backbone(x)), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def backbone_finetuning() -> dict:
    """A global batch of 8 (its share per rank), 3 epochs of 2 steps: each step's loss averaged over the ranks."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    world = int(os.environ.get("WORLD_SIZE", 1))
    model = FineTuned()
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
    trainer(max_epochs=3, limit_train_batches=2, callbacks=[callback]).fit(model, loader(n=32, batch_size=8 // world))
    losses = torch.tensor(model.losses)
    if world > 1:
        torch.distributed.all_reduce(losses)
    return {"losses": (losses / world).tolist()}


def _contrastive(gather: str, precision: str) -> dict:
    from tests.helpers.collective_habits import Contrastive

    model = Contrastive(gather)
    trainer(max_steps=4, precision=precision).fit(model)
    state = model.state_dict()
    return {"losses": model.losses,
            "weights": {k: values(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}}


def collectives_in_step() -> dict:
    from tests.helpers.collective_habits import Talking

    model = Talking()
    t = trainer(max_steps=4)
    t.fit(model)
    state = model.state_dict()
    return {"losses": model.losses, "seeds": model.seeds,
            "weights": {k: values(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()},
            "summary": str(t.strategy.plan.summary()) if STRATEGY == "vitscale" else ""}


class InInferenceMode(Classifier):
    """Inference mode before any training gather, as DDP code writes it: a baseline in ``on_train_start`` and a
    pseudo-label confidence pass at the start of each step (FixMatch's weak view)."""

    def __init__(self) -> None:
        super().__init__("encoder")
        self.baseline: list[float] = []
        self.confidence: list[float] = []

    def on_train_start(self) -> None:
        with torch.inference_mode():
            self.baseline = values(self(PROBE))

    def training_step(self, batch, batch_idx):
        with torch.inference_mode():
            self.confidence.append(self(batch[0]).softmax(-1).amax(-1).mean().item())
        return super().training_step(batch, batch_idx)


def inference_mode_in_hooks_and_steps() -> dict:
    L.seed_everything(0, verbose=False)
    model = InInferenceMode()
    trainer(max_steps=4).fit(model, loader(n=32))
    return {"losses": model.losses, "baseline": model.baseline, "confidence": model.confidence}


def evaluated_in_inference_mode_first() -> dict:
    """``trainer.validate`` and ``trainer.predict`` before ``trainer.fit``, in inference mode as Lightning runs them
    wherever the backend is not gloo (every GPU run): its gloo exception is lifted here, in this process only."""
    from unittest import mock

    import lightning.pytorch.loops.utilities as loops

    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    t = trainer(max_steps=4, limit_val_batches=2)
    modes = []
    with mock.patch.object(loops, "_distributed_is_initialized", lambda: False):
        model.on_validation_batch_start = lambda *_: modes.append(torch.is_inference_mode_enabled())
        metrics = t.validate(model, loader(n=16), verbose=False)
        predictions = t.predict(model, loader(n=8))
    t.fit(model, loader(n=32))
    return {"losses": model.losses, "val_loss": [metrics[0]["val_loss"]], "in_inference_mode": modes,
            "predictions": [float(v) for p in predictions for v in p]}


def _clipped_by_hand(clip: str) -> dict:
    from tests.helpers.collective_habits import ClippedByHand

    model = ClippedByHand(clip)
    trainer(max_steps=4).fit(model)
    state = model.state_dict()
    return {"losses": model.losses, "norms": model.norms,
            "weights": {k: values(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}}


def ema_timm() -> dict:
    from tests.helpers.collective_habits import WithEma

    model = WithEma("timm")
    trainer(max_steps=4).fit(model)
    state = model.ema.state_dict()  # DDP's plain values; ours gathered (every rank)
    return {"losses": model.losses, "ema": {k: values(v) for k, v in state.items() if v.is_floating_point()}}


def one_cycle_schedule() -> dict:
    """OneCycleLR sized by ``self.trainer.estimated_stepping_batches``, the rate read in the step (which the planner
    runs at setup on rank 0 alone), dropout in the backbone."""
    from tests.helpers.schedules import OneCycle

    model = OneCycle()
    trainer(max_epochs=2, limit_train_batches=3).fit(model, loader(64))
    return {"losses": model.losses, "rates": model.rates, "stepping_batches": model.stepping_batches}


def one_rank_call() -> dict:
    """Only rank 0 calls the model after fit: it must fail within the timeout, saying why (VitScaleStrategy only)."""
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    t = trainer(max_steps=1)
    t.fit(model, loader(n=8))

    def probe() -> None:
        with torch.no_grad():
            model(PROBE)

    return rank_zero_alone(probe, timeout=1.5)  # bounds a call that can never succeed (3 s before)


def one_rank_deepcopy() -> dict:
    """Only rank 0 deep-copies the model after fit: a gather, so it fails within the timeout, saying why."""
    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    trainer(max_steps=1).fit(model, loader(n=8))
    return rank_zero_alone(lambda: copy.deepcopy(model), timeout=1.5)


class Histograms(Classifier):
    """DDP's habit: every parameter's and gradient's histogram logged to TensorBoard in ``on_after_backward`` (with
    ``.full_tensor()`` under VitScaleStrategy, on every rank: the experiment writes on rank 0 alone); in the step,
    NumPy reads of the head (an outer-unit parameter, gathered there: its storage is then shared with NumPy)."""

    def __init__(self) -> None:
        super().__init__("encoder")
        self.head_sums: list[float] = []

    def training_step(self, batch, batch_idx):
        import numpy as np

        loss = super().training_step(batch, batch_idx)
        self.head_sums.append(float(np.asarray(self.backbone.head.weight.detach()).sum(dtype=np.float64)))
        return loss

    def on_after_backward(self) -> None:
        for name, p in self.named_parameters():
            for tag, value in ((name, p), (f"{name}.grad", p.grad)):
                if value is not None:
                    whole = value.full_tensor() if isinstance(value, DTensor) else value
                    self.logger.experiment.add_histogram(tag, whole, self.global_step)


def histograms() -> dict:
    """The histograms rank 0 wrote, read back from the event file; each rank's NumPy reads in the step."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    L.seed_everything(0, verbose=False)
    model = Histograms()
    t = trainer(max_steps=3, logger=TensorBoardLogger(sys.argv[1], name=f"histograms_{STRATEGY}", version=0))
    t.fit(model, loader(n=24))
    facts: dict = {"losses": model.losses, "head_sums": model.head_sums}
    if t.is_global_zero:
        events = EventAccumulator(t.logger.log_dir, size_guidance={"histograms": 0})
        events.Reload()
        facts["histograms"] = {tag: [[e.step, e.histogram_value.num, e.histogram_value.sum,
                                      e.histogram_value.sum_squares] for e in events.Histograms(tag)]
                               for tag in events.Tags()["histograms"]}
    return facts


def one_rank_numpy_read() -> dict:
    """The habit as written for DDP: ``add_histogram(name, p)`` runs ``.numpy()`` on rank 0 alone; of a sharded
    parameter it is refused at once, naming the fix, and sends nothing."""
    import numpy as np

    L.seed_everything(0, verbose=False)
    model = Classifier("encoder")
    trainer(max_steps=1).fit(model, loader(n=8))
    weight = model.backbone.head.weight.detach()
    return rank_zero_alone(lambda: np.asarray(weight), timeout=1.5)


COMPARED = {
    "outside_steps": outside_steps,
    "before_first_step": before_first_step,
    "compiled": compiled,
    "weight_averaging": weight_averaging,
    "stochastic_weight_averaging": stochastic_weight_averaging,
    "sync_batchnorm": sync_batchnorm,
    "gradient_norms": gradient_norms,
    "backbone_finetuning": backbone_finetuning,
    **{f"contrastive_{gather}_{precision}": functools.partial(_contrastive, gather, precision)
       for gather in ("lightning", "torch") for precision in ("32-true", "bf16-mixed")},
    **{f"clipped_by_hand_{clip}": functools.partial(_clipped_by_hand, clip) for clip in ("norm", "value")},
    "ema_timm": ema_timm,
    "collectives_in_step": collectives_in_step,
    "inference_mode_in_hooks_and_steps": inference_mode_in_hooks_and_steps,
    "evaluated_in_inference_mode_first": evaluated_in_inference_mode_first,
    "scalar_reads": scalar_reads,
    "histograms": histograms,
    "one_cycle_schedule": one_cycle_schedule,
}
SCENARIOS = under_each_strategy(COMPARED, globals())
ALONE = {"one_rank_call": one_rank_call, "one_rank_deepcopy": one_rank_deepcopy,
         "one_rank_scalar_read": one_rank_scalar_read, "logged_rank_zero_only": logged_rank_zero_only,
         "one_rank_numpy_read": one_rank_numpy_read}
SCENARIOS |= under_each_strategy(ALONE, globals(), ("vitscale",))  # last: these time out


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
