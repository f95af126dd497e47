"""ShardedEMA: a Lightning callback keeping an exponential moving average of the weights, sharded like the weights.

Lightning's ``WeightAveraging`` keeps a whole second model per device and fails on sharded models. Here each rank
averages its own shards (``shards.py``): the same code on FSDP2 shards and on DDP's whole tensors, same numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_vitscale._utils import full_bytes, mib
from lightning_vitscale.averaging.settings import EMABuffers, EMAEvaluate, EMAPolicy
from lightning_vitscale.averaging.shards import EmaShards
from lightning_vitscale.checkpoint.errors import CheckpointError
from lightning_vitscale.checkpoint.formats import EMA_KEY, ShardedEntry

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Callbacks that act on what validation just logged: held back during the EMA pass of evaluate="both", so they
# act once, after the raw pass, with both sets of metrics.
_ACT_ON_VALIDATION_END = (Checkpoint, EarlyStopping)


class ShardedEMA(Callback):
    """Exponential moving average of the weights, kept sharded like the parameters; fp32 under every precision.

    Every rank updates its own shards (``ema = decay * ema + (1 - decay) * weights``, one foreach op per group, no
    collective: 4 bytes per parameter / world size). Saved in sharded checkpoints (resharded on load), in DDP's as
    full tensors; ``python -m lightning_vitscale consolidate SRC DST --weights ema`` exports it.

    Args:
        decay: weight of the old average at each update (``0.999`` to ``0.9999`` in ViT recipes).
        warmup: use ``min(decay, (1 + n) / (10 + n))`` at the ``n``-th update, so the early average forgets the
            initial weights fast (TensorFlow's ``ExponentialMovingAverage(num_updates=...)``).
        update_every_n_steps, update_starting_at_step: update after optimizer step ``i`` (0-based) when
            ``i >= update_starting_at_step`` and ``i % update_every_n_steps == 0`` (as ``EMAWeightAveraging``).
            The first update copies the weights.
        buffers: ``"average"`` (floating buffers such as BatchNorm statistics averaged like the weights, integer
            ones copied) or ``"copy"`` (the EMA model takes the current buffers).
        evaluate: ``"both"`` runs validation/test twice: first with the EMA weights, the module's own metrics
            logged under ``prefix`` (``ema/val_acc``), then the usual pass with the raw weights; checkpointing and
            early stopping act after the second, and may monitor either. ``"ema"`` runs them with the EMA weights
            only (like Lightning's ``WeightAveraging``), ``"raw"`` never swaps.
        offload: keep the EMA shards in CPU memory (each update copies the local shards to the CPU first).
        prefix: prepended to every name the module logs during the EMA pass of ``evaluate="both"``.

    Example::

        trainer = Trainer(strategy=VitScaleStrategy(), callbacks=[ShardedEMA(decay=0.9999, warmup=True)])
        trainer.fit(model)  # logs val_acc and ema/val_acc
    """

    def __init__(
        self, decay: float = 0.999, *, warmup: bool = False, update_every_n_steps: int = 1,
        update_starting_at_step: int = 0, buffers: EMABuffers = "average", evaluate: EMAEvaluate = "both",
        offload: bool = False, prefix: str = "ema/",
    ) -> None:
        self.policy = EMAPolicy(
            decay, warmup, update_every_n_steps, update_starting_at_step, buffers, evaluate, offload
        )
        self.prefix = prefix
        self.shards: EmaShards | None = None
        self._module: nn.Module | None = None
        self.updates = 0  # done so far (the first one copied the weights)
        self._last_step = 0
        self._pending: dict[str, Any] | None = None
        self._ema_missing = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning's CallbackConnector sets `Trainer.callbacks` without declaring it on the class.
        if sum(isinstance(c, ShardedEMA) for c in trainer.callbacks) > 1:  # type: ignore[attr-defined]
            raise ValueError(
                "Only one ShardedEMA callback per Trainer: its average is saved under checkpoint['ema_state_dict']."
                " Remove the extra ShardedEMA from `callbacks`."
            )
        if self._module is not pl_module:  # a new model: the old average does not belong to it
            self.shards, self._module, self.updates, self._last_step = None, pl_module, 0, 0
        _wrap_evaluation_loops(trainer, self._run_evaluation)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _unwrap_evaluation_loops(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        shards = self._ensure(pl_module)
        rank_zero_info(
            f"ShardedEMA: decay {self.policy.decay}{' with warm-up' if self.policy.warmup else ''},"
            f" {len(shards.names)} tensors, {mib(full_bytes(shards.tensors()))}"
            f" on rank 0 ({'CPU' if self.policy.offload else 'next to the parameters'})"
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # optimizer steps so far: unchanged between accumulated micro-batches
        if step <= self._last_step:
            return
        self._last_step = step
        if self.policy.should_update(step - 1):
            self._ensure(pl_module).update(self.policy.decay_at(self.updates))
            self.updates += 1

    @contextmanager
    def averaged(self, trainer: pl.Trainer) -> Iterator[None]:
        """Run the block with the EMA weights in the model (local shards copied in place, no gather), then
        restore the raw weights, e.g. to evaluate or save the EMA model with your own code."""
        shards = self._ensure(trainer.lightning_module)
        if self.updates == 0 and not trainer.sanity_checking:
            rank_zero_warn("ShardedEMA: evaluating an average with no update yet: it equals the starting weights.")
        model = trainer.strategy.model or trainer.lightning_module
        _reshard(model)  # a gathered unit would keep serving the raw weights
        with shards.swapped_in():
            try:
                yield
            finally:
                _reshard(model)

    def _run_evaluation(self, trainer: pl.Trainer, run: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        match self.policy.evaluate:
            case "raw":
                return run()
            case "ema":
                with self.averaged(trainer):
                    return run()
            case "both" if trainer.sanity_checking:
                return run()
            case "both":
                module = trainer.lightning_module
                with self.averaged(trainer), _held_back(trainer), _prefixed_logging(module, self.prefix):
                    averaged = run()
                raw = run()
                return [{**r, **a} for r, a in zip(raw, averaged)]
            case other:
                raise ValueError(f"unknown evaluate={other!r}")

    def _ensure(self, pl_module: pl.LightningModule) -> EmaShards:
        if self.shards is None:
            self.shards = EmaShards(pl_module, self.policy.buffers == "average", self.policy.offload)
            self._module = pl_module
        if self._pending is not None:
            self.shards.load_full(self._pending)
            self._pending = None
        return self.shards

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "last_step": self._last_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step = state_dict["last_step"]
        self.updates = 0 if self._ema_missing else state_dict["updates"]

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.shards is not None or self._pending is not None:
            checkpoint[EMA_KEY] = self._ensure(pl_module).state_dict()  # DTensors under VitScaleStrategy

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        entry = checkpoint.get(EMA_KEY)
        self._ema_missing = entry is None
        if entry is None:
            rank_zero_warn(
                "ShardedEMA: the checkpoint holds no EMA of the weights; the average starts again from the weights"
                " at the next update."
            )
            return
        self.updates = max(self.updates, 1)  # the next update averages into what was loaded
        if not isinstance(entry, ShardedEntry):  # whole tensors (DDP, one file): once the shards exist
            self._pending = entry  # (DDP restores before setup)
            if self.shards is not None:
                self._ensure(pl_module)
            return
        shards = self._ensure(pl_module)  # DCP shards: read straight into this world size's shards
        missing = sorted(set(shards.names) - entry.names())
        if missing:
            raise CheckpointError(
                f"The EMA in {entry.location} lacks {len(missing)} of this model's tensors (e.g. {missing[:3]}):"
                " it was saved for another model. Remove ShardedEMA to load the weights alone."
            )
        entry.load_into(shards.state_dict())


def _evaluation_loops(trainer: pl.Trainer) -> tuple[Any, ...]:
    return trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop


def _wrap_evaluation_loops(
    trainer: pl.Trainer, run_evaluation: Callable[[pl.Trainer, Callable[[], list[dict[str, Any]]]], Any]
) -> None:
    """Route each evaluation loop's ``run`` through ``run_evaluation(trainer, original_run)``: ``evaluate="both"``
    runs a whole pass twice, and Lightning has no hook around a pass that may re-run it. An instance attribute,
    removed at teardown: the class and other Trainers are untouched."""
    for loop in _evaluation_loops(trainer):
        if "run" not in vars(loop):
            vars(loop)["run"] = functools.partial(run_evaluation, trainer, type(loop).run.__get__(loop))


def _unwrap_evaluation_loops(trainer: pl.Trainer) -> None:
    for loop in _evaluation_loops(trainer):
        vars(loop).pop("run", None)


def _reshard(model: nn.Module) -> None:
    """Free gathered FSDP2 parameters (a local operation), so the sharded ones are what the next forward sees."""
    release = getattr(model, "release", None)
    if callable(release):
        release()  # the outer unit: also one rank's compute copies (sharding/compute_copies.py)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def _held_back(trainer: pl.Trainer) -> Iterator[None]:
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    trainer.callbacks = [c for c in callbacks if not isinstance(c, _ACT_ON_VALIDATION_END)]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        trainer.callbacks = callbacks  # type: ignore[attr-defined]


@contextmanager
def _prefixed_logging(module: pl.LightningModule, prefix: str) -> Iterator[None]:
    """The module's ``self.log(name, ...)`` (and ``log_dict``) log ``prefix + name`` inside the block."""
    log = module.log

    def prefixed(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log(prefix + name, value, *args, **kwargs)

    vars(module)["log"] = prefixed
    try:
        yield
    finally:
        vars(module).pop("log", None)
