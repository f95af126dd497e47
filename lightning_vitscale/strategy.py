"""VitScaleStrategy: Lightning hook glue around the parallelize pipeline; a drop-in for ``strategy="ddp"``."""

from __future__ import annotations

import atexit
import dataclasses
import signal
import time
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from typing_extensions import override

from lightning_vitscale._compat import (
    FSDPModule,
    ModelParallelStrategy,
    SubprocessScriptLauncher,
    destroy_process_group_safely,
    lightning_load_sharded_checkpoint,
    optimizers_to_device,
    set_lightning_device,
)
from lightning_vitscale.attention import AttentionRouter, describe_choice, measure
from lightning_vitscale.checkpoint import load_full_into, model_shapes, save_sharded, validate_against
from lightning_vitscale.creation import Creation, ModelCreation
from lightning_vitscale.kernels import fuse_optimizers
from lightning_vitscale.parallelize import Parallelized, parallelize
from lightning_vitscale.plan import ParallelPlan
from lightning_vitscale.policies import (
    CheckpointingPolicy,
    CheckpointSelector,
    InitMode,
    KernelMode,
    KernelPolicy,
    ModuleSelector,
    ParallelConfig,
    ShardingPolicy,
    resolve_init,
    resolve_kernels,
)
from lightning_vitscale.precision import VitScalePrecision, to_vitscale_precision

if TYPE_CHECKING:
    import lightning.pytorch as pl

DEFAULT_TIMEOUT = timedelta(minutes=10)
_ROOT_ATTR = "_vitscale_root_unit"


class RootUnit(nn.Module):
    """The outer FSDP unit around the LightningModule.

    Lightning calls ``training_step``, never ``forward``, so a unit on the LightningModule would never gather
    its parameters. Lightning's forward redirection calls this module instead, whose ``forward`` runs the
    step: FSDP's hooks fire around the whole step, and a ``self(x)`` inside the step does not re-enter them.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def prefer_foreach(optimizers: list[torch.optim.Optimizer]) -> None:
    """Turn the optimizer's per-parameter loop into foreach ops where the user left the choice to torch.

    Each op on a DTensor pays a dispatch cost; torch defaults to the per-parameter loop on CPU, which made a
    sharded AdamW step ~7x slower than DDP's here. One foreach op per update covers all parameters. An explicit
    ``foreach=False`` or ``fused=True`` from the user is kept.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True


_registered_exit_cleanup = False
# How long exiting waits for gloo's worker threads to drop the work objects of the last collectives.
_EXIT_GRACE_S = 0.1


def _destroy_process_group_at_exit() -> None:
    """Destroy the process group, and let gloo's worker threads settle, while Python is still fully alive.

    Lightning registers the destroy for NCCL only. Under gloo the *worker thread* releases a finished
    collective's work object; if its reference is the last one and the release comes once interpreter teardown
    has begun, freeing the work's tensors needs a GIL it can no longer take and the process aborts ("terminate
    called without an active exception", SIGABRT in ``AsyncAllgatherWork::~AsyncAllgatherWork``; caught in a
    core dump of this project's demo on an oversubscribed 2-core machine). Gloo has no shutdown that joins its
    threads, so the exit handler gives them a short grace period to drop those references first.
    """
    global _registered_exit_cleanup
    if not _registered_exit_cleanup:
        atexit.register(_exit_cleanup)
        _registered_exit_cleanup = True


def _exit_cleanup() -> None:
    destroy_process_group_safely()
    time.sleep(_EXIT_GRACE_S)


class ShardedModuleReuseError(RuntimeError):
    """A LightningModule sharded under some settings was handed to a Trainer with other settings."""


def check_reusable(used: dict[str, Any], wanted: dict[str, Any]) -> None:
    """A sharded module is rebuilt by nobody: FSDP units, checkpointing and casts are in place. Refuse to pretend."""
    changed = [f"{key} {used[key]!r} -> {wanted[key]!r}" for key in wanted if used.get(key) != wanted[key]]
    if changed:
        raise ShardedModuleReuseError(
            "This LightningModule was already sharded by a VitScaleStrategy with other settings ("
            + "; ".join(changed)
            + "). Its FSDP units, activation checkpointing and precision casts cannot be undone in place. Build a"
            " new LightningModule instance for this Trainer, or pass the same strategy settings as before."
        )


class VitScaleStrategy(ModelParallelStrategy):
    """Shard any LightningModule with nested FSDP2, activation checkpointing and BF16 O2 — no model changes.

    Args:
        blocks: ``None`` finds the repeated blocks automatically; a set of block classes or a predicate
            ``(name, module) -> bool`` overrides the discovery. Each block becomes its own FSDP unit.
        activation_checkpointing: ``True`` (every block), ``False``, ``k`` (every k-th block) or a predicate.
        kernels: ``"auto"`` (CUDA: per-block ``torch.compile``, fused AdamW, and xformers attention where it is
            installed and measures faster; CPU: eager), ``"eager"``, or a :class:`KernelPolicy`.
        reshard_after_forward: ``None`` = the recipe (blocks free gathered parameters after forward, the outer
            unit keeps what backward needs); ``True``/``False`` forces it for all units.
        timeout: bound on every collective, so a rank that dies cannot leave the others waiting forever.
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
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
        reshard_after_forward: bool | int | None = None,
        kernels: KernelMode | KernelPolicy = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        init: InitMode = "auto",
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.config = ParallelConfig(
            sharding=ShardingPolicy(blocks=blocks, reshard_after_forward=reshard_after_forward),
            checkpointing=CheckpointingPolicy(blocks=activation_checkpointing),
        )
        if not isinstance(kernels, KernelPolicy):
            resolve_kernels(kernels, torch.device("cpu"))  # unknown strings fail here, not at setup
        self._kernels = kernels
        resolve_init(init, 0, None)  # unknown modes fail here, not at setup
        self._init = init
        self._creation: Creation | None = None
        self._config_for_device: ParallelConfig | None = None
        self.plan: ParallelPlan | None = None
        self._parallelized_state: Parallelized | None = None

    @property
    @override
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
        # One data-parallel mesh dimension over all ranks: ModelParallelStrategy's default would make every
        # process a tensor-parallel peer (data-parallel size 1, no sharding, same data on every rank).
        self._setup_distributed()  # sets the device, ranks and the process group (with our timeout)
        _destroy_process_group_at_exit()
        self._device_mesh = init_device_mesh(
            self.root_device.type, (self.world_size,), mesh_dim_names=("data_parallel",)
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self.model = self._parallelized(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

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
        signature = self._signature()
        existing = module.__dict__.get(_ROOT_ATTR)
        if existing is None:
            precision = self.precision_plugin
            module = precision.convert_module(module)
            # No `module.to(device)` first: FSDP moves each unit's shards to the device as it shards the unit.
            root = RootUnit(module)
            config = self._resolved_config()
            creation, self._creation = self._creation, None
            done = parallelize(root, module, self.device_mesh, config, precision.policy, self.root_device, creation)
            set_lightning_device(module, self.root_device)
            # Kept in __dict__ (not as a submodule): the LightningModule must not contain its own wrapper.
            existing = module.__dict__[_ROOT_ATTR] = (root, done, signature)
            rank_zero_info(done.plan.summary())
        root, self._parallelized_state, used = existing
        check_reusable(used, signature)
        self.plan = self._parallelized_state.plan
        return root

    def _signature(self) -> dict[str, Any]:
        """The settings a sharded module was built with; another Trainer may reuse it only with the same ones."""
        config = self._resolved_config()
        return {
            "blocks=": config.sharding.blocks,
            "reshard_after_forward=": config.sharding.reshard_after_forward,
            "activation_checkpointing=": config.checkpointing.blocks,
            "kernels=": config.kernels,
            "precision": self.precision_plugin.policy,
            "world size": self.world_size,
            "device": self.root_device,
        }

    def _resolved_config(self) -> ParallelConfig:
        """The config with ``kernels=`` resolved for this device (known only once processes are set up)."""
        if self._config_for_device is None:
            kernels = resolve_kernels(self._kernels, self.root_device)
            self._config_for_device = dataclasses.replace(self.config, kernels=kernels)
        return self._config_for_device

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._resolved_config().kernels.fused_optimizer:
            fused = fuse_optimizers(self.optimizers)
            if fused and self.plan is not None:
                self.plan.notes.extend(fused)
        prefer_foreach(self.optimizers)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        router = self._parallelized_state.router if self._parallelized_state is not None else None
        if router is None or router.decided:
            return super().training_step(*args, **kwargs)
        if router.recorded:
            self._decide_attention(router)
            return super().training_step(*args, **kwargs)
        # attention="auto": the first step shows the real shapes. It runs eagerly, so recording them is plain
        # Python; compiled blocks meet the router only once it is decided (then retrace once if it routes).
        with router.record(), torch.compiler.set_stance("force_eager"):
            return super().training_step(*args, **kwargs)

    def _decide_attention(self, router: AttentionRouter) -> None:
        """Time each kernel on the recorded shapes and route every rank the same way (summed timings)."""
        local = measure(router.calls, list(router.candidates))
        summed = self.reduce(
            torch.tensor(list(local.values()), dtype=torch.float64, device=self.root_device), reduce_op="sum"
        )
        totals = {name: float(ms) / self.world_size for name, ms in zip(local, summed.tolist())}
        choice = min(totals, key=totals.__getitem__)  # ties, and no calls at all, keep SDPA (measure's first key)
        router.decide(choice)
        line = describe_choice(choice, totals, router.calls)
        if self.plan is not None:
            self.plan.kernels["attention"] = line
        rank_zero_info(f"VitScaleStrategy attention: {line}")

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

    def _reshard_root(self) -> None:
        # FSDP2 keeps the outer unit gathered after forward for backward; an eval loop has no backward, so
        # free the gathered copy ourselves (users then see sharded DTensors again, and memory drops).
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
        """Sharded state dict keyed like the plain LightningModule (no wrapper or FSDP prefixes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.lightning_module is not None
        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        return get_model_state_dict(self.lightning_module, options=options)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        assert self.lightning_module is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its own shards (no rank gathers the model); the save is atomic, see checkpoint.py."""
        if storage_options is not None:
            raise TypeError("VitScaleStrategy.save_checkpoint does not take storage_options: it writes DCP shards.")
        path = Path(self.broadcast(str(filepath)))
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        save_sharded(tensors, checkpoint, path, self.is_global_zero, self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint (any world size) or a single file (e.g. from DDP or `consolidate`).

        Every rank validates keys and shapes before the first collective, so a wrong path or model fails
        with the same message everywhere instead of leaving ranks waiting on each other.
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        assert module is not None
        validate_against(path, model_shapes(module), strict=module.strict_loading)
        if path.is_file():
            return load_full_into(path, module, self.optimizers, strict=module.strict_loading)
        state: dict[str, Any] = {"state_dict": module}
        state.update({f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)})
        return lightning_load_sharded_checkpoint(
            path, state, strict=module.strict_loading, optimizer_states_from_list=True, weights_only=weights_only
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Nested FSDP2 + activation checkpointing + BF16 O2 with fp32 norms (lightning-vitscale)",
        )
