"""Rank script: Lightning's own callbacks, Trainer flags and overridden hooks, each run under ``"ddp"`` and
``VitScaleStrategy()`` with the same seed and data; results keyed ``<scenario>/<strategy>`` for the test to compare.

``OnExceptionCheckpoint`` is checked where an error can stop a step (its start, after the forward, after the
backward, before the optimizer step, in the validation loop): the file saved, then a run resumed from it.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelSummary,
    OnExceptionCheckpoint,
    SpikeDetection,
    ThroughputMonitor,
)
from lightning.pytorch.loggers import CSVLogger

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Classifier, loader
from tests.helpers.scenarios import run_scenarios, under_each_strategy
from tests.helpers.state import full

warnings.filterwarnings("ignore")
STRATEGY = "vitscale"  # set for each run (`under_each_strategy`)


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)), logger=False,
        strategy=VitScaleStrategy() if STRATEGY == "vitscale" else "ddp", enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def folder(name: str) -> Path:
    made = Path(sys.argv[1]) / STRATEGY / name
    made.mkdir(parents=True, exist_ok=True)
    return made


def weights(model: torch.nn.Module) -> list[float]:
    """Each parameter's sum, gathered (a collective): training apart shows in every one of them."""
    return [float(full(p).double().sum()) for p in model.parameters()]


def trained(model: Classifier, **facts) -> dict:
    return {"losses": model.losses, "weights": weights(model), **facts}


def accumulation_scheduler() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    trainer(max_epochs=3, callbacks=[GradientAccumulationScheduler({0: 1, 1: 3, 2: 2})]).fit(model, loader(n=56))
    return trained(model)


def early_stopping() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    run = trainer(max_epochs=8, limit_val_batches=2, callbacks=[EarlyStopping("val_loss", min_delta=0.05, patience=0)])
    run.fit(model, loader(n=32), loader(n=16, seed=1))
    return trained(model, epoch=run.current_epoch, val=model.val_losses)


class Plateau(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


def plateau_and_learning_rate_monitor() -> dict:
    L.seed_everything(0, verbose=False)
    model = Plateau()
    logger = CSVLogger(folder("lr"), name="", version=0)
    run = trainer(max_epochs=4, limit_val_batches=2, logger=logger, log_every_n_steps=1,
                  callbacks=[LearningRateMonitor("step")])
    run.fit(model, loader(n=32), loader(n=16, seed=1))
    run.strategy.barrier()  # rank 0 writes the file (the logger is rank 0's): read once it has
    logged = (folder("lr") / "version_0" / "metrics.csv").read_text().splitlines() if run.global_rank == 0 else [""]
    return trained(model, lr=run.optimizers[0].param_groups[0]["lr"], logged=len(logged), header=logged[0])


class Interrupted(Classifier):
    """Raises once, at global step 3, where ``stop`` says."""

    def __init__(self, stop: str | None) -> None:
        super().__init__()
        self.stop = stop

    def _maybe_stop(self, where: str) -> None:
        if self.stop == where and self.global_step == 3:
            raise RuntimeError(f"stopped {where}")

    def training_step(self, batch, batch_idx):
        self._maybe_stop("step_start")
        loss = super().training_step(batch, batch_idx)
        self._maybe_stop("after_forward")
        return loss

    def on_after_backward(self) -> None:
        self._maybe_stop("after_backward")

    def on_before_optimizer_step(self, optimizer) -> None:
        self._maybe_stop("before_optimizer_step")

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        if batch_idx == 1:
            self._maybe_stop("validation")


STOPS = ("step_start", "after_forward", "after_backward", "before_optimizer_step", "validation")


def _interrupted_then_resumed(stop: str) -> dict:
    L.seed_everything(0, verbose=False)
    model, saved = Interrupted(stop), folder(f"exception_{stop}")
    loops = dict(max_steps=6, val_check_interval=3, limit_val_batches=3)
    try:
        trainer(**loops, enable_checkpointing=True, callbacks=[OnExceptionCheckpoint(saved)]).fit(
            model, loader(n=32), loader(n=16, seed=1))
        error = None
    except RuntimeError as raised:
        error = str(raised)
    L.seed_everything(0, verbose=False)
    resumed = Interrupted(None)
    trainer(**loops).fit(resumed, loader(n=32), loader(n=16, seed=1), ckpt_path=str(saved / "on_exception.ckpt"))
    return {"error": error, "before": model.losses, "losses": resumed.losses, "val": resumed.val_losses,
            "weights": weights(resumed)}


class Written(BasePredictionWriter):
    def __init__(self, where: Path) -> None:
        super().__init__("epoch")
        self.where = where

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        torch.save({"predictions": predictions, "indices": batch_indices}, self.where / f"{trainer.global_rank}.pt")


def prediction_writer() -> dict:
    L.seed_everything(0, verbose=False)
    model, where = Classifier(), folder("predictions")
    run = trainer(max_steps=3, callbacks=[Written(where)])
    run.fit(model, loader(n=32))
    run.predict(model, loader(n=20, seed=2), return_predictions=False)
    run.strategy.barrier()
    saved = torch.load(where / f"{run.global_rank}.pt")
    return trained(model, predictions=[p.tolist() for p in saved["predictions"]], indices=saved["indices"])


def model_summary() -> dict:
    L.seed_everything(0, verbose=False)
    model, seen = Classifier(), {}

    class Kept(ModelSummary):
        def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs):
            seen.update(total=total_parameters, trainable=trainable_parameters, size=round(model_size, 4),
                        rows=[list(map(str, column[1])) for column in summary_data])

    trainer(max_steps=2, enable_model_summary=True, callbacks=[Kept(max_depth=2)]).fit(model, loader(n=32))
    return trained(model, **seen)


def throughput_and_spikes() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    run = trainer(max_steps=6, logger=CSVLogger(folder("throughput"), name="", version=0), log_every_n_steps=1,
                  callbacks=[ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2),
                             SpikeDetection(window=2, warmup=1, rtol=100.0,
                                            exclude_batches_path=str(folder("spikes")))])
    run.fit(model, loader(n=48))
    return trained(model, keys=sorted(run.logged_metrics), samples=float(run.logged_metrics.get("train/samples", -1)))


class HooksOverridden(Classifier):
    """A warm-up in ``optimizer_step``, gradients zeroed in place, clipping from the third step by hand."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        for group in optimizer.param_groups:
            group["lr"] = min(1.0, (self.trainer.global_step + 1) / 4) * 1e-2
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if self.trainer.global_step >= 2:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def hooks_overridden() -> dict:
    L.seed_everything(0, verbose=False)
    model = HooksOverridden()
    trainer(max_steps=6).fit(model, loader(n=48))
    return trained(model)


def anomaly_detection_and_profiler() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    trainer(max_steps=3, detect_anomaly=True, profiler="simple").fit(model, loader(n=32))
    return trained(model)


def overfit_batches() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    trainer(max_epochs=3, overfit_batches=2).fit(model, loader(n=32))
    return trained(model)


def ema_weight_averaging() -> dict:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    trainer(max_steps=5, callbacks=[EMAWeightAveraging(decay=0.5)]).fit(model, loader(n=48))
    return trained(model)


class Reloaded(Classifier):
    def train_dataloader(self):
        return loader(n=16 + 8 * self.current_epoch, seed=self.current_epoch)


def reloaded_dataloaders() -> dict:
    L.seed_everything(0, verbose=False)
    model = Reloaded()
    trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1).fit(model)
    return trained(model)


COMPARED = {
    "accumulation_scheduler": accumulation_scheduler,
    "early_stopping": early_stopping,
    "plateau_and_learning_rate_monitor": plateau_and_learning_rate_monitor,
    **{f"exception_{stop}": (lambda stop=stop: _interrupted_then_resumed(stop)) for stop in STOPS},
    "prediction_writer": prediction_writer,
    "model_summary": model_summary,
    "throughput_and_spikes": throughput_and_spikes,
    "hooks_overridden": hooks_overridden,
    "anomaly_detection_and_profiler": anomaly_detection_and_profiler,
    "overfit_batches": overfit_batches,
    "ema_weight_averaging": ema_weight_averaging,
    "reloaded_dataloaders": reloaded_dataloaders,
}


SCENARIOS = under_each_strategy(COMPARED, globals())

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
