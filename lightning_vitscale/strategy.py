"""VitScaleStrategy: Lightning hook glue around the parallelize pipeline; a drop-in for ``strategy="ddp"``."""

from __future__ import annotations

import dataclasses
import functools
import signal
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_vitscale import checkpoint_io, full_state_dict
from lightning_vitscale._compat import (
    FSDPModule,
    ModelParallelStrategy,
    SubprocessScriptLauncher,
    optimizers_to_device,
    set_device_mesh,
    set_lightning_device,
    setup_distributed,
)
from lightning_vitscale.attention import usable_backends
from lightning_vitscale.attention_auto import auto_attention_step
from lightning_vitscale.auto_checkpointing import AutoCheckpointing, describe_prediction, measure_for_summary
from lightning_vitscale.checkpoint import consolidate_command
from lightning_vitscale.checkpoint_storage import Location
from lightning_vitscale.collective_guard import open_side_group
from lightning_vitscale.compiled import TAKEN_OVER, take_over_compiled
from lightning_vitscale.creation import Creation, ModelCreation
from lightning_vitscale.kernels import fuse_optimizers, prefer_foreach
from lightning_vitscale.lightning_averaging import shard_averaged_copies
from lightning_vitscale.mesh import build_mesh, shard_size
from lightning_vitscale.parallelize import Parallelized, parallelize
from lightning_vitscale.plan import ParallelPlan
from lightning_vitscale.policies import (
    CheckpointingPolicy,
    CheckpointSelector,
    Compiler,
    InitMode,
    KernelMode,
    KernelPolicy,
    ModuleSelector,
    OffloadMode,
    ParallelConfig,
    ShardingLayout,
    ShardingPolicy,
    StateDictType,
    resolve_init,
    resolve_kernels,
    resolve_state_dict_type,
    shard_group_size,
)
from lightning_vitscale.precision import VitScalePrecision, to_vitscale_precision
from lightning_vitscale.process_group import destroy_process_group_at_exit
from lightning_vitscale.reuse import check_reusable, sharding_signature
from lightning_vitscale.root_unit import RootUnit
from lightning_vitscale.sync_batchnorm import apply_sync_batchnorm
from lightning_vitscale.traffic import describe_layout

if TYPE_CHECKING:
    import lightning.pytorch as pl

DEFAULT_TIMEOUT = timedelta(minutes=10)
_ROOT_ATTR = "_vitscale_root_unit"


class VitScaleStrategy(ModelParallelStrategy):
    """Shard any LightningModule with nested FSDP2, activation checkpointing and BF16 O2 — no model changes.

    Args:
        blocks: ``None`` finds the repeated blocks automatically; a set of block classes or a predicate
            ``(name, module) -> bool`` overrides the discovery. Each block becomes its own FSDP unit.
        activation_checkpointing: ``True`` (every block), ``False``, ``k`` (every k-th block), a predicate, or
            ``"auto"``: the fewest blocks that keep the predicted per-rank step peak within ``memory_budget``
            (decided at setup from ``example_input_array``, else at the first training step from its batch).
        memory_budget: only with ``"auto"``: bytes (int) or a fraction of device memory (float, default 0.9;
            on CPU of the host's available memory divided among the local ranks).
        kernels: ``"auto"`` (CUDA: per-block ``torch.compile``, fused AdamW, and xformers attention where it is
            installed and measures faster; CPU: eager), ``"eager"``, or a :class:`KernelPolicy`.
        reshard_after_forward: ``None`` = the recipe (blocks free gathered parameters after forward, the outer
            unit keeps what backward needs); ``True``/``False`` forces it for all units.
        sharding: ``"full"`` shards over every rank (least memory); ``"hybrid"`` shards inside each node and
            replicates across nodes (all-gathers and reduce-scatters stay on intra-node links; only one gradient
            all-reduce per unit crosses nodes); an ``int`` sets the shard-group size (it must divide the world).
        offload: ``"cpu"`` keeps sharded parameters, gradients and optimizer state in host memory (the optimizer
            steps on the CPU); on ``accelerator="cpu"`` they already are, and it changes nothing.
        timeout: bound on every collective, so a rank that dies cannot leave the others waiting forever.
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
        state_dict_type: ``"sharded"`` (default): checkpoints are folders, each rank writes its own shards;
            ``"full"``: rank 0 writes one file in DDP's format (gathered one tensor at a time), which
            ``MyModule.load_from_checkpoint`` reads and a ``strategy="ddp"`` run resumes from.
        init: how a model built in ``configure_model()`` gets its starting weights: ``"exact"`` (rank 0 builds it,
            the others build on meta and receive their shards from rank 0 unit by unit: DDP's weights bit for bit,
            one full copy on rank 0's host), ``"meta"`` (every rank builds on meta and runs the model's own init on
            its shards) or ``"auto"`` (exact when that copy fits in rank 0's host memory).

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
        timeout: timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        state_dict_type: StateDictType = "sharded",
        init: InitMode = "auto",
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if not isinstance(kernels, KernelPolicy):
            resolve_kernels(kernels, torch.device("cpu"), ())  # unknown strings fail here, not at setup
        # `config.kernels` stays the requested mode until setup knows the device, then holds the resolved policy.
        self.config = ParallelConfig(
            sharding=ShardingPolicy(
                blocks=blocks, reshard_after_forward=reshard_after_forward, layout=sharding, offload=offload
            ),
            checkpointing=CheckpointingPolicy(blocks=activation_checkpointing, memory_budget=memory_budget),
            kernels=kernels,
        )
        self.state_dict_type = resolve_state_dict_type(state_dict_type)
        self._told_how_to_consolidate = False
        resolve_init(init, 0, None)  # unknown modes fail here, not at setup
        self._init = init
        self._creation: Creation | None = None
        self.plan: ParallelPlan | None = None
        self._parallelized_state: Parallelized | None = None
        self._user_compiler: Compiler | None = None
        self._auto: AutoCheckpointing | None = None

    @property  # type: ignore[override]
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_vitscale_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        # Trainer.fit(torch.compile(model)) stores the unwrapped module here, then refuses every strategy outside
        # its own list: take the compile over first (compiled.py) and compile the blocks instead.
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
        # Gathers outside a step (model calls, state_dict()) first agree on it, so one rank alone never gathers.
        open_side_group(self._timeout or DEFAULT_TIMEOUT)
        shard = shard_group_size(self.config.sharding.layout, self.world_size, self.num_processes)
        mesh = build_mesh(self.root_device.type, self.world_size, shard)
        assert self.lightning_module is not None
        set_device_mesh(self, self.lightning_module, mesh)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every rank reads its own data, whatever the mesh's shape (Lightning's looks up a "data_parallel" dim).
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING:  # as DDP: only when fitting
            apply_sync_batchnorm(self._layer_sync, module, self.root_device)
        self.model = self._parallelized(module)
        self.model.release()  # a copy gathered by a call after an earlier fit must not reach the optimizer
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            # WeightAveraging & co.: their averaged copy sharded like the model.
            callbacks = trainer.callbacks  # type: ignore[attr-defined]
            shard_averaged_copies(callbacks, module, self.root_device, bool(trainer.checkpoint_callbacks))
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and self.config.sharding.offload is None:
            optimizers_to_device(self.optimizers, self.root_device)  # offloaded state stays in host memory

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Where ``configure_model()`` runs: rank 0 builds for real, the others on meta (see creation.py)."""
        assert self.lightning_module is not None
        host_copies = 1.0 + (self.num_processes / self.world_size if self.root_device.type == "cpu" else 0.0)
        creation = ModelCreation(self.lightning_module, self._init, self.global_rank, self.world_size, host_copies)
        with creation.context():
            yield
        self._creation = creation.result or self._creation

    def _parallelized(self, module: pl.LightningModule) -> RootUnit:
        """Shard ``module`` once; later fit/validate/test calls with the same settings reuse the same units."""
        config = self._resolved_config()
        signature = sharding_signature(config, self.precision_plugin.policy, self.world_size, self.root_device)
        existing = module.__dict__.get(_ROOT_ATTR)
        if existing is None:
            precision = self.precision_plugin
            module = precision.convert_module(module)
            # No `module.to(device)` first: FSDP moves each unit's shards to the device as it shards the unit.
            root = RootUnit(module)
            if config.checkpointing.is_auto:
                self._auto = AutoCheckpointing(
                    config.checkpointing.memory_budget, self.world_size, precision.policy.name,
                    config.sharding.blocks, config.sharding.reshard_after_forward is None,
                )
                config = self._auto.config_at_setup(module, config, self.root_device, self.num_processes,
                                                    self._agree_max)
                measured = None
            else:
                measured = measure_for_summary(module, self.world_size, precision.policy.name, config.sharding.blocks,
                                               self.root_device)
            creation, self._creation = self._creation, None
            done = parallelize(root, module, self.device_mesh, config, precision.policy, self.root_device, creation)
            set_lightning_device(module, self.root_device)
            mesh = self.device_mesh
            describe_layout(
                done.plan, root, done.norms.params if done.norms is not None else [], precision.policy,
                config.sharding, mesh.size(), shard_size(mesh), self.num_processes, self.global_rank,
                self.root_device,
            )
            if self._auto is not None:
                self._auto.keep_gathered(module)
                self._auto.note(done.plan)
            if measured is not None:
                reshard = config.sharding.reshard_after_forward is not False
                done.plan.predicted_peak, done.plan.memory = describe_prediction(measured, done.plan.checkpointed,
                                                                                 reshard)
            # Kept in __dict__ (not as a submodule): the LightningModule must not contain its own wrapper.
            root.enable_calls_outside_steps()
            full_state_dict.install(module, root)  # model.state_dict() outside our checkpoint code: DDP's full tensors
            existing = module.__dict__[_ROOT_ATTR] = (root, done, signature)
            rank_zero_info(done.plan.summary())
        root, self._parallelized_state, used = existing
        check_reusable(used, signature)
        self.plan = self._parallelized_state.plan
        return root

    def _resolved_config(self) -> ParallelConfig:
        """The config with ``kernels=`` resolved for this device (known only once processes are set up)."""
        device = self.root_device
        kernels = resolve_kernels(self.config.kernels, device, usable_backends(device))  # idempotent
        if self._user_compiler is not None and isinstance(kernels, KernelPolicy):
            # trainer.fit(torch.compile(model)): the user's compile settings, applied block by block
            kernels = dataclasses.replace(kernels, compile_blocks=True, compiler=self._user_compiler)
        self.config = dataclasses.replace(self.config, kernels=kernels)
        return self.config

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        kernels = self._resolved_config().kernels
        if isinstance(kernels, KernelPolicy) and kernels.fused_optimizer:  # always a KernelPolicy once resolved
            fused = fuse_optimizers(self.optimizers)
            if fused and self.plan is not None:
                self.plan.notes.extend(fused)
        prefer_foreach(self.optimizers)

    def _agree_max(self, value: int) -> int:
        return int(self.reduce(torch.tensor(value, device=self.root_device), reduce_op="max").item())

    def _auto_first_step(self, batch: Any) -> None:
        assert self._auto is not None and self.lightning_module is not None
        self._auto.apply_at_first_step(self.lightning_module, batch, self.root_device, self.num_processes,
                                       self._agree_max, self.optimizers)
        if self.plan is not None:
            self._auto.note(self.plan)
            rank_zero_info(f"VitScaleStrategy activation checkpointing {self.plan.memory}")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._auto is not None and self._auto.pending and args:
            self._auto_first_step(args[0])
        step = functools.partial(super().training_step, *args, **kwargs)
        return auto_attention_step(self._parallelized_state, step, self._mean_over_ranks)

    def _mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        # SUM, then divide: gloo has no AVG.
        return self.reduce(values.to(self.root_device), reduce_op="sum") / self.world_size

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # fp32 norms live outside FSDP's units: average their gradients here, once per backward.
        if self._parallelized_state is not None and self._parallelized_state.norms is not None:
            self._parallelized_state.norms.reduce_grads()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Stop the local ranks this process started: Lightning only does so on Ctrl+C, and a rank that raised
        leaves its peers blocked in a collective (or busy) with nobody to end them."""
        super().on_exception(exception)
        launcher = self.launcher
        if isinstance(launcher, SubprocessScriptLauncher) and launcher.procs:
            rank_zero_warn(f"{type(exception).__name__} on rank {self.global_rank}: stopping the other local ranks.")
            launcher.kill(signal.SIGKILL)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        if isinstance(self.model, RootUnit):
            self.model.release()  # a copy gathered by a callback before the update is stale now
        return output

    def _reshard_root(self) -> None:
        # FSDP2 keeps the outer unit gathered after forward for backward; an eval loop has no backward, so
        # free the gathered copy ourselves (users then see sharded DTensors again, and memory drops).
        if isinstance(self.model, RootUnit):
            self.model.release()
        if isinstance(self.model, FSDPModule):
            self.model.reshard()

    @override
    def on_validation_end(self) -> None:
        self._reshard_root()

    @override
    def on_test_end(self) -> None:
        self._reshard_root()

    @override
    def on_predict_end(self) -> None:
        self._reshard_root()

    @override
    def model_to_device(self) -> None:
        # FSDP2 moves each unit's parameters to the mesh device when it shards them.
        pass

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return checkpoint_io.model_state_dict(self.lightning_module, full=self.state_dict_type == "full")

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        full = self.state_dict_type == "full"
        return checkpoint_io.optimizer_state_dict(self.lightning_module, optimizer, full, self.is_global_zero)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``"sharded"``: every rank writes its own shards, atomically; ``"full"``: rank 0 writes one file, as DDP."""
        location = Location.of(self.broadcast(str(filepath)))
        if self.state_dict_type == "full":
            write = partial(self.checkpoint_io.save_checkpoint, checkpoint, filepath, storage_options=storage_options)
            checkpoint_io.save_full(location, self.is_global_zero, write, self.barrier)
            return
        if storage_options is not None:
            raise TypeError(
                "VitScaleStrategy(state_dict_type='sharded') writes DCP shards and takes no storage_options;"
                " use state_dict_type='full' to save through the Trainer's CheckpointIO plugin."
            )
        checkpoint_io.save_sharded(checkpoint, location, self.is_global_zero, self.barrier)
        if not self._told_how_to_consolidate:
            self._told_how_to_consolidate = True
            rank_zero_info(
                f"Sharded checkpoint folder written: {location}. `MyModule.load_from_checkpoint(path)` and a resume"
                " under strategy='ddp' read it in any process that has imported lightning_vitscale. One torch.save"
                f" file for other tools: `{consolidate_command(location.url)}`, or VitScaleStrategy(state_dict_type="
                "'full')."
            )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint (any world size) or a single file (e.g. from DDP or `consolidate`).

        Every rank validates keys and shapes before the first collective, so a wrong path or model fails
        with the same message everywhere instead of leaving ranks waiting on each other. ``weights_only=None``
        is torch's default (True), as under DDP, for every pickle read (files, ``meta.pt``, DCP metadata).
        """
        location = Location.of(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        assert module is not None
        return checkpoint_io.load(location, module, self.optimizers, module.strict_loading, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # `lr_find` and ModelCheckpoint call this on every rank; a sharded folder goes only once all are done.
        checkpoint_io.remove(Location.of(self.broadcast(str(filepath))), self.is_global_zero, self.barrier)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Nested FSDP2 + activation checkpointing + BF16 O2 with fp32 norms (lightning-vitscale)",
        )
