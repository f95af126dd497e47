"""VitScaleStrategy: Lightning's hooks, each delegating to one concern; a drop-in for ``strategy="ddp"``."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_vitscale import checkpoint as checkpoints
from lightning_vitscale import distributed
from lightning_vitscale import sharding as shards
from lightning_vitscale._compat import ModelParallelStrategy, optimizers_to_device, process_group_timeout
from lightning_vitscale.averaging import shard_averaged_copies
from lightning_vitscale.checkpoint.lightning import ResumeLauncher
from lightning_vitscale.init import Creation, InitMode, InitSettings, ModelCreation, host_copies
from lightning_vitscale.kernels import Compiler, KernelMode, KernelPolicy, prepare_optimizers, take_over_compiled
from lightning_vitscale.memory import AccumulationMode, may_release_after_step
from lightning_vitscale.options import document
from lightning_vitscale.precision import VitScalePrecision, note_fp32_fix, to_vitscale_precision
from lightning_vitscale.sharding import CheckpointSelector, ModuleSelector, OffloadMode, Priority, ShardingLayout

if TYPE_CHECKING:
    import lightning.pytorch as pl

DEFAULT_TIMEOUT = timedelta(minutes=10)


@distributed.counting_whereabouts  # evaluation batches and collectives, told to a rank waiting alone (whereabouts.py)
class VitScaleStrategy(ModelParallelStrategy):
    """Shard any LightningModule with nested FSDP2, BF16 O2 and the fastest plan that fits — no model changes.

    Example::

        # before: Trainer(strategy="ddp", precision="bf16-mixed")
        trainer = Trainer(strategy=VitScaleStrategy(), precision="bf16-mixed", devices=8, num_nodes=4)
        trainer.fit(model)
        print(trainer.strategy.plan.summary())
    """

    strategy_name = "vitscale"

    def __init__(
        self,
        *,
        blocks: ModuleSelector | None = None,
        priority: Priority = "speed",
        activation_checkpointing: CheckpointSelector | None = None,
        memory_budget: int | float | None = None,
        reshard_after_forward: bool | int | None = None,
        kernels: KernelMode | KernelPolicy = "auto",
        sharding: ShardingLayout = "full",
        tensor_parallel: int = 1,
        tensor_plan: shards.TensorPlanSelector | None = None,
        offload: OffloadMode | None = None,
        accumulation: AccumulationMode = "auto",
        prefetch: int | None = None,
        blocks_per_unit: int | None = None,
        find_unused_parameters: shards.SkippedBlocks = False,
        timeout: timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        state_dict_type: checkpoints.StateDictType = "sharded",
        init: InitMode = "auto",
        auto_resume: bool = False,
        async_save: bool = False,
    ) -> None:
        self._module: pl.LightningModule | None = None  # before Strategy.__init__, which stores the module there
        self._compiler: Compiler | None = None  # `Trainer.fit(torch.compile(model))`'s settings, for the blocks
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.config = shards.ParallelConfig(  # the request, each setting checked by its dataclass
            sharding=shards.ShardingPolicy(
                blocks=blocks, reshard_after_forward=reshard_after_forward, layout=sharding, offload=offload,
                accumulation=accumulation, prefetch=prefetch, blocks_per_unit=blocks_per_unit,
                find_unused_parameters=find_unused_parameters, tensor_parallel=tensor_parallel, tensor_plan=tensor_plan,
            ),
            checkpointing=shards.CheckpointingPolicy(blocks=activation_checkpointing, memory_budget=memory_budget),
            kernels=kernels, priority=priority,
        )
        settings = checkpoints.CheckpointSettings(state_dict_type, auto_resume, async_save)
        self.checkpoints = checkpoints.StrategyCheckpoints(settings, timeout)  # saves, loads, resume fallbacks
        self.init_settings = InitSettings(init)
        self.resolved: shards.ResolvedConfig | None = None  # what setup made of `config` on this device
        self.sharded: shards.ShardedModel | None = None
        self._creation: Creation | None = None
        self._release_after_step = False  # decided at setup: see memory/gradient_release.py

    @property
    def plan(self) -> shards.SetupSummary | None:
        """What setup did to the model (``print(strategy.plan.summary())``); ``None`` before setup."""
        return self.sharded.summary if self.sharded is not None else None

    checkpoint_settings = checkpoints.OnCheckpointSide[checkpoints.CheckpointSettings]("settings")
    state_dict_type = checkpoints.OnCheckpointSide[checkpoints.StateDictType]("state_dict_type")

    # `Trainer.fit(torch.compile(model))` stores the unwrapped module here; its compile taken over (kernels/compile.py)
    @property  # type: ignore[override]
    def _lightning_module(self) -> pl.LightningModule | None:
        return self._module

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        self._compiler = take_over_compiled(module) or self._compiler
        self._module = module

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning then injects DistributedSampler and honours `sync_dist` (accelerator_connector)

    # `sync_dist=True` of a sharded value: DDP's; each first lets skipped blocks join (sharding/stand_ins.py)
    reduce = shards.finishing_forward(distributed.reducing_whole(ModelParallelStrategy.reduce))
    all_gather = shards.finishing_forward(ModelParallelStrategy.all_gather)
    broadcast = shards.finishing_forward(ModelParallelStrategy.broadcast)
    backward = shards.naming_graph_inputs(shards.joining_on_loss(ModelParallelStrategy.backward))  # inputs= too
    barrier = checkpoints.unless_alone_in_exception(ModelParallelStrategy.barrier)  # after an exception's lone save
    load_model_state_dict = checkpoints.model_state_after_hook  # on_load_checkpoint's checkpoint["state_dict"]

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> VitScalePrecision:
        return p if isinstance(p := self._precision_plugin, VitScalePrecision) else VitScalePrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands a custom strategy a generic plugin for `Trainer(precision=...)`: the user's flag, translated.
        self._precision_plugin = None if plugin is None else to_vitscale_precision(plugin)

    @override
    def _configure_launcher(self) -> None:
        distributed.check_accelerator(self.accelerator)
        self._launcher = ResumeLauncher(self.cluster_environment, self.num_processes, self.num_nodes, self.checkpoints)

    @override
    def setup_environment(self) -> None:
        # Every rank data-parallel (ModelParallelStrategy's: all tensor-parallel); tensor_parallel=k: a last mesh dim.
        shard_group = partial(shards.shard_group_size, self.config.sharding.layout)
        distributed.start_process_group(self, self.lightning_module, process_group_timeout(self) or DEFAULT_TIMEOUT,
                                        shard_group, tensor_parallel=self.config.sharding.tensor_parallel)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Each data-parallel rank its own data, a TP group's ranks the same (Lightning's needs a "data_parallel" dim).
        return distributed.data_parallel_ranks(self.device_mesh, self.world_size, self.global_rank)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module, fitting = self.lightning_module, trainer.state.fn == TrainerFn.FITTING
        if fitting:  # as DDP: only when fitting
            shards.apply_sync_batchnorm(self._layer_sync, module, self.root_device)
        self.resolved = shards.resolve_config(self.config, self.root_device, self._compiler)
        creation, self._creation = self._creation, None
        self.sharded = shards.shard_lightning_module(module, self.resolved, self.precision_plugin, self._ranks(),
                                                     creation, fitting=trainer if fitting else None, trainer=trainer)
        self.model = self.sharded.outer
        self.sharded.outer.release()  # a copy gathered by a call after an earlier fit must not reach the optimizer
        self.barrier()
        if fitting:
            callbacks = trainer.callbacks  # type: ignore[attr-defined]  # WeightAveraging & co.: copies sharded too
            shard_averaged_copies(callbacks, module, self.root_device, bool(trainer.checkpoint_callbacks))
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting and self.config.sharding.offload is None:
            optimizers_to_device(self.optimizers, self.root_device)  # offloaded state stays in host memory
        self._release_after_step = fitting and may_release_after_step(module, trainer)  # decided once per setup

    _ranks = distributed.rank_context

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Where ``configure_model()`` runs: rank 0 builds for real, the others on meta (see init/creation.py)."""
        assert self.lightning_module is not None
        copies = host_copies(self.root_device, self.num_processes, self.world_size)
        creation = ModelCreation(self.lightning_module, self.init_settings, self.global_rank, self.world_size, copies)
        with creation.context():
            yield
        self._creation = creation.result or self._creation

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        notes = prepare_optimizers(self.optimizers, self.resolved is not None and self.resolved.kernels.fused_optimizer)
        if self.sharded is not None:  # its summary is the plan
            self.sharded.summary.notes.extend(notes + self.sharded.take_optimizers(self.optimizers))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None
        self.sharded.before_training_step(args[0] if args else None, self._ranks(), self.optimizers)
        mean = partial(distributed.mean_over_ranks, device=self.root_device)
        return self.sharded.training_step(partial(super().training_step, *args, **kwargs), mean)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.sharded is not None:
            self.sharded.before_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.sharded is not None:
            self.sharded.after_backward()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's ``no_sync`` for micro-batches before the last: see ``ShardedModel.accumulating``."""
        sharded, compute, mode = self.sharded, self.precision_plugin.policy.compute, self.config.sharding.accumulation
        with sharded.accumulating(mode, self._ranks(), compute) if sharded is not None else nullcontext():
            yield

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.sharded.step_errors_named() if self.sharded is not None else nullcontext():
            output = super().optimizer_step(*args, **kwargs)  # automatic optimization: forward and backward too
        if self.sharded is not None:  # zero_grad would free the gradients only after the next forward
            self.sharded.after_optimizer_step(args[0] if args else kwargs["optimizer"], self._release_after_step)
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        shards.note_the_fix(exception)  # a shard read as DDP's whole tensor (a weight histogram): the fix, noted
        note_fp32_fix(exception, self.lightning_module, self.precision_plugin.policy, self.precision_plugin.precision)
        distributed.stop_local_ranks(self.launcher, exception, self.global_rank)

    @override
    def on_train_start(self) -> None:  # Lightning's SIGTERM handler runs a collective: a lone signal hangs the job
        distributed.take_over_sigterm(self.lightning_module, self.launcher)

    on_validation_start = on_test_start = on_predict_start = on_train_start

    @override
    def on_validation_end(self) -> None:
        if self.sharded is not None:
            self.sharded.reshard()  # the outer unit, gathered for the loop's calls

    on_test_end = on_predict_end = on_validation_end

    @override
    def model_to_device(self) -> None:
        """Nothing to do: FSDP2 moves each unit's parameters to the mesh device when it shards them."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoints.model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.checkpoints.optimizer_state(self.lightning_module, optimizer, self._ranks())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``"sharded"``: every rank writes its own shards, atomically; ``"full"``: rank 0 writes one file, as DDP."""
        write = partial(self.checkpoint_io.save_checkpoint, checkpoint, filepath, storage_options=storage_options)
        self.checkpoints.save(
            checkpoint, filepath, ranks=self._ranks(), write_full=write, storage_options=storage_options,
            trainer=self.lightning_module.trainer,  # type: ignore[union-attr]  # set: a Trainer is saving it
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.checkpoints.before_train_batch()

    @override
    def on_train_end(self) -> None:
        self.precision_plugin.on_train_end()  # the last fused step's non-finite flags, read before fit returns
        self.checkpoints.after_fit()

    @override
    def teardown(self) -> None:
        self.checkpoints.close()
        super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder (any world size) or one file (DDP's, ``consolidate``'s): ``StrategyCheckpoints.load``."""
        module, ranks = self.lightning_module, self._ranks()
        return self.checkpoints.load(checkpoint_path, module, self.optimizers, weights_only, ranks=ranks)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath, ranks=self._ranks())  # called on every rank; removed once all are done

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "Nested FSDP2 + activation checkpointing + BF16 O2 with fp32 norms (lightning-vitscale)"
        strategy_registry.register(cls.strategy_name, cls, description=description)


VitScaleStrategy.__doc__ = document(VitScaleStrategy)  # Args from the settings dataclasses (options.py)
