"""VitScaleStrategy: Lightning's hooks, each delegating to one concern; a drop-in for ``strategy="ddp"``."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_vitscale import checkpoint as checkpoints
from lightning_vitscale._compat import (
    ModelParallelStrategy,
    optimizers_to_device,
    set_device_mesh,
    setup_distributed,
)
from lightning_vitscale.averaging import shard_averaged_copies
from lightning_vitscale.distributed import (
    build_mesh,
    destroy_process_group_at_exit,
    open_side_group,
    stop_local_ranks,
    watch_local_ranks,
)
from lightning_vitscale.init import Creation, InitMode, InitSettings, ModelCreation
from lightning_vitscale.kernels import (
    TAKEN_OVER,
    Compiler,
    KernelMode,
    KernelPolicy,
    prepare_optimizers,
    take_over_compiled,
)
from lightning_vitscale.memory import AccumulationMode, may_release_after_step, release_gradients
from lightning_vitscale.options import document
from lightning_vitscale.precision import VitScalePrecision, to_vitscale_precision
from lightning_vitscale.sharding import (
    CheckpointingPolicy,
    CheckpointSelector,
    ModuleSelector,
    OffloadMode,
    ParallelConfig,
    ParallelPlan,
    Ranks,
    ResolvedConfig,
    ShardedModel,
    ShardingLayout,
    ShardingPolicy,
    apply_sync_batchnorm,
    resolve_config,
    shard_group_size,
    shard_lightning_module,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

DEFAULT_TIMEOUT = timedelta(minutes=10)


class VitScaleStrategy(ModelParallelStrategy):
    """Shard any LightningModule with nested FSDP2, activation checkpointing and BF16 O2 — no model changes.

    Every keyword argument is documented once, in the settings dataclasses; the Args below are generated from
    them at import (``lightning_vitscale/options.py``).

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
        activation_checkpointing: CheckpointSelector = True,
        memory_budget: int | float | None = None,
        reshard_after_forward: bool | int | None = None,
        kernels: KernelMode | KernelPolicy = "auto",
        sharding: ShardingLayout = "full",
        offload: OffloadMode | None = None,
        accumulation: AccumulationMode = "auto",
        prefetch: int | None = None,
        blocks_per_unit: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        state_dict_type: checkpoints.StateDictType = "sharded",
        init: InitMode = "auto",
        auto_resume: bool = False,
        async_save: bool = False,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        # Every setting is checked here, by its own dataclass. `config.kernels` stays the requested mode until
        # setup knows the device, then holds the resolved policy.
        self.config = ParallelConfig(
            sharding=ShardingPolicy(
                blocks=blocks, reshard_after_forward=reshard_after_forward, layout=sharding, offload=offload,
                accumulation=accumulation, prefetch=prefetch, blocks_per_unit=blocks_per_unit,
            ),
            checkpointing=CheckpointingPolicy(blocks=activation_checkpointing, memory_budget=memory_budget),
            kernels=kernels,
        )
        self.checkpoint_settings = checkpoints.CheckpointSettings(state_dict_type, auto_resume, async_save)
        self._async_saves = checkpoints.AsyncSaves(timeout)
        # Older complete checkpoints that `auto_resume` / `ckpt_path="last"` found, tried in order if the chosen
        # one fails its CRC-32 check at load (checkpoint/resume.py sets them, load_checkpoint consumes them).
        self.resume_fallbacks: list[checkpoints.Location] = []
        self.init_settings = InitSettings(init)
        self.sharded: ShardedModel | None = None
        self._creation: Creation | None = None
        self._user_compiler: Compiler | None = None
        self._told_how_to_consolidate = False

    resolved: ResolvedConfig | None = None
    """What setup resolved ``config`` to on this device (kernels, checkpointed blocks, prefetch); ``None`` before."""

    @property
    def plan(self) -> ParallelPlan | None:
        """What setup did to the model (``print(strategy.plan.summary())``); ``None`` before setup."""
        return self.sharded.summary if self.sharded is not None else None

    @property
    def state_dict_type(self) -> checkpoints.StateDictType:
        return self.checkpoint_settings.state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, value: checkpoints.StateDictType) -> None:
        self.checkpoint_settings = dataclasses.replace(self.checkpoint_settings, state_dict_type=value)

    @property  # type: ignore[override]
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_vitscale_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        # Trainer.fit(torch.compile(model)) stores the unwrapped module here, then refuses every strategy outside
        # its own list: take the compile over first (kernels/compiled_model.py) and compile the blocks instead.
        compiler = take_over_compiled(module)
        if compiler is not None:
            rank_zero_info(TAKEN_OVER)
            self._user_compiler = compiler
        self.__dict__["_vitscale_lightning_module"] = module

    @property
    def is_distributed(self) -> bool:
        # Tells Lightning to inject DistributedSampler and honour `sync_dist` (see accelerator_connector).
        return True

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> VitScalePrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, VitScalePrecision) else VitScalePrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's connector hands a custom strategy a generic plugin for `Trainer(precision=...)`;
        # translate it here so the user's flag keeps working after the drop-in from DDP.
        self._precision_plugin = None if plugin is None else to_vitscale_precision(plugin)

    @override
    def _configure_launcher(self) -> None:
        if self.accelerator is not None and not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise ValueError(
                f"VitScaleStrategy runs on accelerator='cpu' (gloo) or 'cuda' (NCCL), not"
                f" {type(self.accelerator).__name__}. Pass Trainer(accelerator='cuda') or accelerator='cpu'."
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # Every rank is data-parallel (ModelParallelStrategy's default would make every process a tensor-parallel
        # peer: no sharding, same data on every rank). 1-D mesh for "full", (replicate, shard) for hybrid layouts.
        setup_distributed(self)  # sets the device, ranks and the process group (with our timeout)
        destroy_process_group_at_exit()
        watch_local_ranks(self.launcher)  # a child rank's death leaves this rank's own `except`/`finally` to run
        # Gathers outside a step (model calls, state_dict()) first agree on it, so one rank alone never gathers.
        open_side_group(self._timeout or DEFAULT_TIMEOUT)
        shard = shard_group_size(self.config.sharding.layout, self.world_size, self.num_processes)
        assert self.lightning_module is not None
        set_device_mesh(self, self.lightning_module, build_mesh(self.root_device.type, self.world_size, shard))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every rank reads its own data, whatever the mesh's shape (Lightning's looks up a "data_parallel" dim).
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # as DDP: only when fitting
            apply_sync_batchnorm(self._layer_sync, module, self.root_device)
        self.resolved = resolve_config(self.config, self.root_device, self._user_compiler)
        self.config = self.resolved.config_view()  # the request; `.kernels` the resolved policy, deprecated
        creation, self._creation = self._creation, None
        self.sharded = shard_lightning_module(module, self.resolved, self.precision_plugin, self._ranks(), creation)
        self.model = self.sharded.outer
        self.sharded.release()  # a copy gathered by a call after an earlier fit must not reach the optimizer
        self.barrier()
        if fitting:
            # WeightAveraging & co.: their averaged copy sharded like the model.
            callbacks = trainer.callbacks  # type: ignore[attr-defined]
            shard_averaged_copies(callbacks, module, self.root_device, bool(trainer.checkpoint_callbacks))
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting and self.config.sharding.offload is None:
            optimizers_to_device(self.optimizers, self.root_device)  # offloaded state stays in host memory

    def _ranks(self) -> Ranks:
        return Ranks(self.device_mesh, self.root_device, self.global_rank, self.num_processes, self._agree_max)

    def _agree_max(self, value: int) -> int:
        return int(self.reduce(torch.tensor(value, device=self.root_device), reduce_op="max").item())

    def _mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        # SUM, then divide: gloo has no AVG.
        return self.reduce(values.to(self.root_device), reduce_op="sum") / self.world_size

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Where ``configure_model()`` runs: rank 0 builds for real, the others on meta (see init/creation.py)."""
        assert self.lightning_module is not None
        host_copies = 1.0 + (self.num_processes / self.world_size if self.root_device.type == "cpu" else 0.0)
        creation = ModelCreation(
            self.lightning_module, self.init_settings, self.global_rank, self.world_size, host_copies
        )
        with creation.context():
            yield
        self._creation = creation.result or self._creation

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        fused = prepare_optimizers(self.optimizers, self.resolved is not None and self.resolved.kernels.fused_optimizer)
        if self.plan is not None:
            self.plan.notes.extend(fused)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None
        if args:
            self.sharded.before_training_step(args[0], self._ranks(), self.optimizers)
        return self.sharded.training_step(partial(super().training_step, *args, **kwargs), self._mean_over_ranks)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.sharded is not None:
            self.sharded.after_backward()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's ``no_sync`` for micro-batches before the last: see ``ShardedModel.accumulating``."""
        if self.sharded is None:
            yield
            return
        compute = self.precision_plugin.policy.compute
        with self.sharded.accumulating(self.config.sharding.accumulation, self._ranks(), compute):
            yield

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        if self.sharded is not None:
            self.sharded.release()  # a copy gathered by a callback before the update is stale now
        optimizer = args[0] if args else kwargs.get("optimizer")
        if optimizer is not None and may_release_after_step(self.lightning_module, [optimizer]):
            release_gradients(optimizer)  # zero_grad would free them only after the next forward
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        stop_local_ranks(self.launcher, exception, self.global_rank)

    @override
    def on_validation_end(self) -> None:
        self._reshard_outer_unit()

    @override
    def on_test_end(self) -> None:
        self._reshard_outer_unit()

    @override
    def on_predict_end(self) -> None:
        self._reshard_outer_unit()

    def _reshard_outer_unit(self) -> None:
        if self.sharded is not None:
            self.sharded.reshard()

    @override
    def model_to_device(self) -> None:
        # FSDP2 moves each unit's parameters to the mesh device when it shards them.
        pass

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return checkpoints.model_state_dict(self.lightning_module, full=self.checkpoint_settings.full)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        full = self.checkpoint_settings.full
        return checkpoints.optimizer_state_dict(self.lightning_module, optimizer, full, self.is_global_zero)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``"sharded"``: every rank writes its own shards, atomically; ``"full"``: rank 0 writes one file, as DDP."""
        location = checkpoints.Location.of(self.broadcast(str(filepath)))
        write = partial(self.checkpoint_io.save_checkpoint, checkpoint, filepath, storage_options=storage_options)
        saves = self._async_saves if self._saves_in_background() else None
        checkpoints.save_checkpoint(
            checkpoint, location, self.checkpoint_settings, self.is_global_zero, self.barrier, write, storage_options,
            self._hash_group(), saves,
        )
        if not self.checkpoint_settings.full and not self._told_how_to_consolidate:
            self._told_how_to_consolidate = True
            rank_zero_info(checkpoints.sharded_save_hint(location))

    def _saves_in_background(self) -> bool:
        """``async_save`` applies while ``fit`` runs, which waits for the last save; any other save (after ``fit``,
        from ``validate``) is written before it returns, as without the option."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return (
            self.checkpoint_settings.async_save
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._async_saves.raise_if_failed()  # a background save that failed since the last step

    @override
    def on_train_end(self) -> None:
        self._async_saves.wait()  # after ModelCheckpoint's last save: fit returns with every save committed

    @override
    def teardown(self) -> None:
        self._async_saves.close()  # also after an exception, which close() does not mask
        super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint (any world size) or a single file (e.g. from DDP or `consolidate`).

        Every rank validates keys and shapes before the first collective, so a wrong path or model fails
        with the same message everywhere instead of leaving ranks waiting on each other. ``weights_only=None``
        is torch's default (True), as under DDP, for every pickle read (files, ``meta.pt``, DCP metadata).
        A path whose save was interrupted loads the newest complete checkpoint saved to it; a sharded folder's
        CRC-32s are checked first, shared by the ranks (checkpoint/verified.py).
        """
        self._async_saves.wait()
        location = checkpoints.Location.of(self.broadcast(str(checkpoint_path)))
        fallbacks, self.resume_fallbacks = self.resume_fallbacks, []
        location = checkpoints.verified_checkpoint(location, fallbacks, self._hash_group())
        module = self.lightning_module
        assert module is not None
        return checkpoints.load_checkpoint(location, module, self.optimizers, module.strict_loading, weights_only)

    def _hash_group(self) -> checkpoints.HashGroup:
        return checkpoints.HashGroup(self.global_rank, self.world_size, self._all_gather_objects)

    def _all_gather_objects(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, value)
        return gathered

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # `lr_find` and ModelCheckpoint call this on every rank; a sharded folder goes only once all are done.
        self._async_saves.wait()  # a folder still being written must not be deleted under the writer
        location = checkpoints.Location.of(self.broadcast(str(filepath)))
        checkpoints.remove_checkpoint(location, self.is_global_zero, self.barrier)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Nested FSDP2 + activation checkpointing + BF16 O2 with fp32 norms (lightning-vitscale)",
        )


VitScaleStrategy.__doc__ = document(VitScaleStrategy)  # Args from the settings dataclasses (options.py)
