"""Every private torch/Lightning import and version gate lives here, so upgrades touch one file.

Public torch names (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``DTensor``, ...) are imported from
torch where they are used, not through this module."""

from __future__ import annotations

import contextlib
import copyreg
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])
# pyproject's floor: the oldest torch the whole test suite has passed on.
TORCH_TESTED_MIN = Version("2.14")
# The oldest torch this package runs on: the lent GPU image's (2.11, preinstalled, no network, used through
# `PYTHONPATH=.`). The names that differ below the floor go through the version branches marked "torch 2.11" below;
# tests/unit/test_compat.py resolves each name on the torch it applies to, and holds the gate to the GPU image.
TORCH_API_MIN = Version("2.11")


def torch_below_floor(version: str) -> str | None:
    """What to warn about ``torch`` ``version`` (``None``: nothing); an ``ImportError`` below what the package runs
    on. The gate once stood at the tested floor and refused every GPU run (that image has 2.11): keep them apart."""
    found = Version(version.split("+")[0])
    if found < TORCH_API_MIN:
        raise ImportError(
            f"lightning-vitscale needs torch>={TORCH_API_MIN}; found {version}. Upgrade torch:"
            f" `pip install -U 'torch>={TORCH_TESTED_MIN}'` (the oldest version the whole suite passed on)."
        )
    if found < TORCH_TESTED_MIN:
        return (f"lightning-vitscale: torch {version} is below {TORCH_TESTED_MIN}, the oldest torch the whole test"
                f" suite has passed on (see the README's table of what ran where). It runs; upgrade torch"
                f" (`pip install -U 'torch>={TORCH_TESTED_MIN}'`) for the tested stack.")
    return None


if (_below := torch_below_floor(torch.__version__)) is not None:  # pragma: no cover - CI runs the floor
    import warnings

    warnings.warn(_below, UserWarning, stacklevel=2)

# pickle's own reconstructors (stdlib, loadable anywhere): a plain copy's reduction where the strategy changed the
# module's class (sharding/plain_copy.py); typeshed lists neither.
PICKLE_NEWOBJ: Callable[..., Any] = getattr(copyreg, "__newobj__")  # noqa: B009
PICKLE_RECONSTRUCTOR: Callable[..., Any] = getattr(copyreg, "_reconstructor")  # noqa: B009

# Below the gate, so an old torch fails with the message above rather than on a missing name (ruff: E402 allowed
# in this file only, see pyproject.toml).
import torch._dynamo as dynamo  # regional compilation's dynamo options (kernels/compile.py)
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver as ChildProcessObserver
from lightning.fabric.utilities.distributed import _destroy_dist_connection as destroy_process_group_safely
from lightning.fabric.utilities.load import _METADATA_FILENAME as METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch.core.optimizer import (  # the planner's twin: its optimizers and schedulers, parsed
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
    _configure_schedulers_manual_opt,
)
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric  # what self.log keeps
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from torch._functorch import config as functorch_config  # planner: fake tensors that carry real values
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # memory planner: shapes without memory
from torch._tensor import _rebuild_from_type_v2 as rebuild_from_type_v2  # FSDP1 local files: a tensor subclass
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor_v2  # FSDP1 local files: a plain tensor, pickled
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # s3://, gs://, memory://
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo  # where a DCP value lies in a file
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_into
from torch.distributed.fsdp import FSDPModule  # public: for the code below only (import it from torch)
from torch.distributed.fsdp._common_utils import FSDP_PREFIX
from torch.distributed.fsdp._fully_shard import _fsdp_param as _fsdp_param_module  # its free_storage, guarded
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterComm  # FSDP2 custom comms
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState  # units of several modules (torch 2.11)
from torch.distributed.tensor import DTensor  # public: for the code below only (import it from torch)
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # a DTensor made in an op handler
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # a DTensor shard's box (init/)
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # planner: a step's .item() on fake tensors
from torch.multiprocessing.reductions import StorageWeakRef  # planner: a storage's life, whoever holds it
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.nn.modules.instancenorm import _InstanceNorm as InstanceNormBase
from torch.optim.optimizer import _get_fused_kernels_supported_devices as fused_kernel_devices
from torch.serialization import _get_layout as get_layout  # FSDP1 local files: a tensor's layout, pickled
from torch.utils._python_dispatch import TorchDispatchMode  # planner and init replay: every op on tensors
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # planner: real values
from torch.utils._pytree import tree_leaves, tree_map

# Every private torch/Lightning name the package uses, with what it is for; tests/unit/test_compat.py resolves each
# on the installed torch/Lightning (a missing one fails naming it, the versions and this file) and checks that no
# other module uses one. Only the names a subclass overrides (marked) appear outside this file, in the subclass.
PRIVATE_NAMES = {
    "copyreg._reconstructor": "stdlib pickle's class-rebuilding reducer: plain_copy.py (a module whose class changed)",
    "torch._dynamo": "regional compilation's dynamo options (kernels/compile.py)",
    "torch.distributed.distributed_c10d._get_default_store": "the handshakes' store (distributed/handshake.py)",
    "torch._C._distributed_c10d.FakeWork": "planner: a collective a measured step sends, done on this rank alone",
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop": "its broadcast at each training batch's start",
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor": "the same: a rank"
    " there ended its batch (distributed/whereabouts.py; Lightning >= 2.6, absent before: nothing to see)",
    "torch._subclasses.fake_tensor.FakeTensor": "memory planner: shapes without memory",
    "torch._functorch.config.fake_tensor_propagate_real_tensors": "planner: fake tensors carrying real values",
    "torch._functorch.config.generate_fake_kernels_from_real_mismatches": "planner: the real value's shape stands",
    "torch._subclasses.fake_tensor.FakeTensorMode": "memory planner: shapes without memory",
    "torch._tensor._rebuild_from_type_v2": "FSDP1 local files: a pickled tensor subclass",
    "torch._utils._rebuild_tensor_v2": "FSDP1 local files: a pickled plain tensor",
    "torch.utils._pytree.tree_leaves": "the tensors in a nested structure",
    "torch.utils._pytree.tree_map": "a function over the tensors in a nested structure",
    "torch.utils._python_dispatch.TorchDispatchMode": "planner and init replay: every op on tensors",
    "torch.utils._python_dispatch._disable_current_modes": "planner: a fake tensor's real value read outside the mode",
    "torch.serialization._get_layout": "FSDP1 local files: a pickled tensor's layout",
    "torch.serialization._get_restore_location": "torch.load's `map_location` rule, applied to one storage",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecReader": "DCP at a URL (s3://, gs://, memory://)",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter": "DCP at a URL (s3://, gs://, memory://)",
    "torch.distributed.checkpoint.filesystem._StorageInfo": "where a DCP value lies in a file",
    "torch.distributed.checkpoint.format_utils._EmptyStateDictLoadPlanner": "a whole DCP checkpoint, one process",
    # Not the public `dcp.load`, which fills a copy of the state dict: the keys it populates would be lost.
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict": "a whole DCP checkpoint, one process",
    "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter": "FSDP2 custom reduce-scatter (CPU overlap)",
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state": "a unit's FSDP2 state (the FSDP names below)",
    "torch.distributed.fsdp.FSDPModule._set_unshard_async_op": "CPU: prefetched all-gathers overlap compute",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._lazy_init": "the root fixed before a child's call",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_groups": "a unit's own parameters",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_group": "the same on torch 2.11",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState": "torch 2.11: units of several modules completed",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._force_complete_incomplete_states": "whether it must",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._modules": "torch 2.11: the modules of one unit",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._modules_to_run_forward": "torch 2.11: a unit run part",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._register_pre_backward_hook": "torch 2.11: completed",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._training_state": "torch 2.11: completed, idle",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._pre_backward": "the root's pre-backward on a loss",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._training_state": "torch 2.11: idle",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_forward_mesh_info": "reshard after"
    " forward, per unit: kept gathered through a gradient of a gradient",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.reshard_after_backward": "the same after"
    " backward",
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._unsharded_param": "deepcopy: a gathered parameter;"
    " the tensor a step's graph holds for a shard (`torch.autograd.grad(loss, self.parameters())`)",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": "a DTensor shard's box (init/)",
    "torch.distributed.tensor.DTensor._local_tensor": "the local shard without an autograd node; flat masters",
    "torch._utils._unflatten_dense_tensors": "flat groups: views shaped as each parameter in one C++ call",
    "torch.distributed.tensor.DTensor._spec": "a gradient laid out as its parameter, every step",
    "torch._C.TensorBase.data": "torch's own `.data` getter, under the in-place setter (sharding/parameter_writes.py)",
    "torch.nn.modules.batchnorm._BatchNorm": "norm detection and SyncBatchNorm conversion",
    "torch.nn.modules.instancenorm._InstanceNorm": "norm detection",
    "torch.nn.Module._parameters": "a module's own parameter slots, written without the nn.Parameter check",
    "torch.nn.Module._buffers": "a module's own buffer slots",
    "torch.nn.Module._non_persistent_buffers_set": "a module's buffers its state_dict leaves out",
    "torch.Tensor._version": "a buffer updated in place by a checkpointed forward",
    "torch.nn.Module._forward_pre_hooks": "planner: blocks with the same hooks are alike; outer-unit entry hooks",
    "torch.nn.Module._forward_hooks": "planner: blocks with the same hooks are alike; outer-unit entry hooks",
    "torch.nn.Module._backward_pre_hooks": "planner: blocks with the same hooks are alike",
    "torch.nn.Module._backward_hooks": "planner: blocks with the same hooks are alike",
    "torch.nn.MultiheadAttention._reset_parameters": "init replay: its only re-initialiser",
    "torch.nn.init._no_grad_trunc_normal_": "init replay: `trunc_normal_`, which returns early on meta tensors",
    "torch.UntypedStorage._cdata": "a storage's identity (fake and meta tensors have no data pointer)",
    "torch._ops.OpOverload._schema": "planner and selective checkpointing: whether and which inputs an op writes",
    "torch.optim.optimizer._get_fused_kernels_supported_devices": "fused optimizer steps",
    "torch.optim.Adam._step_supports_amp_scaling": "an optimizer that unscales inside its own step",
    "torch.Tensor._post_accumulate_grad_hooks": "CPU overlap: a parameter whose gradient is taken by a hook",
    "torch._C._disabled_torch_function_impl": "DTensor's own `__torch_function__`: put back after a step, and"
    " called for every operation a step's term on shards does not mix (sharding/whole_terms.py)",
    "torch.distributed.tensor.DTensor._op_dispatcher": "whether the user asked DTensor to take plain tensors as"
    " replicated (`implicit_replication()`): then left to DTensor (sharding/whole_terms.py)",
    "torch.distributed.tensor._dispatch.OpDispatcher._allow_implicit_replication": "the same",
    "torch.distributed.tensor._dispatch.OpDispatcher._custom_op_handlers": "DTensor's handlers of single ops (torch's"
    " loss_parallel adds its own): a scalar read of a sharded tensor gathers it (distributed/scalar_reads.py), a max"
    " over empty shards (distributed/empty_shards.py)",
    "lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric": "what `self.log` keeps of a"
    " value: a DTensor made whole as it is logged (distributed/scalar_reads.py)",
    "lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric.update": "the same",
    "lightning.pytorch.trainer.connectors.logger_connector.result._Metadata.sync": "whether it was logged on rank 0"
    " alone (`rank_zero_only=True`)",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": "a DTensor made by such a handler from its local value",
    "torch.distributed.tensor._dtensor_spec.TensorMeta": "the same",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.comm_ctx": "the streams that write a unit's"
    " gradient shards, waited for before a term's gradient is added to one (sharding/direct_gradients.py)",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPCommContext.reduce_scatter_stream": "the same",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPCommContext.all_reduce_stream": "the same (HSDP)",
    "torch._amp_foreach_non_finite_check_and_unscale_": "GradScaler's fused unscale and check, on local shards",
    "torch._foreach_copy_": "ShardedEMA: one kernel per step",
    "torch._foreach_lerp_": "ShardedEMA: one kernel per step",
    "torch._foreach_mul_": "ShardedEMA: one kernel per step",
    "torch._foreach_add_": "ShardedEMA: one kernel per step",
    "torch.amp.GradScaler._unscale_grads_": "overridden by precision/grad_scaler.py: DTensor gradients",
    "torch._C._current_graph_task_id": "the id of the running backward",
    "torch._C._dispatch_get_all_op_names": "ops other libraries registered (precision/library_ops.py)",
    "torch._C._dispatch_has_kernel_for_dispatch_key": "which of them say how autocast runs them",
    "torch.autograd.Variable._execution_engine": "a callback at the end of the running backward",
    "torch.autograd._engine_run_backward": "what `torch.autograd.grad` calls, however it was imported",
    "torch.distributed.tensor.parallel.ParallelStyle._apply": "overridden by sharding/tensor_parallel.py",
    "lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver": "a failed child: our teardown",
    "lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver._child_processes": "its children",
    "lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver._terminate_all": "replaced",
    "lightning.fabric.utilities.distributed._destroy_dist_connection": "process-group teardown",
    "lightning.fabric.utilities.load._METADATA_FILENAME": "the file that marks a DCP folder",
    "lightning.fabric.utilities.optimizer._optimizers_to_device": "optimizer state to the device, as Lightning",
    "lightning.pytorch.core.module.LightningModule._device": "what `LightningModule.device` reports",
    "lightning.pytorch.core.module.LightningModule._device_mesh": "what `LightningModule.device_mesh` reports",
    "lightning.pytorch.utilities.compile.from_compiled._compiler_ctx": "the compile context it leaves on a module",
    "lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher": "its launcher, kept",
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._configure_launcher": "overridden",
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._setup_distributed": "the process group",
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._device_mesh": "the strategy's mesh",
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._timeout": "the process groups' timeout",
    "lightning.pytorch.strategies.strategy.Strategy._precision_plugin": "overridden by strategy.py: its plugin",
    "lightning.pytorch.plugins.precision.Precision._after_closure": "a precision plugin's own optimizer step",
    "lightning.pytorch.callbacks.ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir": "a ModelCheckpoint's folder",
    "lightning.pytorch.callbacks.WeightAveraging._average_model": "its averaged copy, sharded like the model",
    "lightning.pytorch.callbacks.WeightAveraging._device": "the device it keeps the copy on",
    "lightning.pytorch.callbacks.StochasticWeightAveraging._average_model": "its averaged copy, sharded",
    "lightning.pytorch.trainer.connectors.signal_connector._HandlersCompose": "Lightning's SIGTERM handler",
    "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector._sigterm_notifier_fn": "its notifier",
    "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector.received_sigterm": "SIGTERM seen",
    "lightning.pytorch.trainer.trainer.Trainer._signal_connector": "where the SIGTERM flag is",
    "lightning.pytorch.loops.fit_loop._FitLoop._data_source": "what `fit` will train on, before setup",
    "lightning.pytorch.core.optimizer._configure_optimizers": "the planner's twin: what configure_optimizers gave",
    "lightning.pytorch.core.optimizer._configure_schedulers_automatic_opt": "the twin's schedulers, as the trainer's",
    "lightning.pytorch.core.optimizer._configure_schedulers_manual_opt": "the twin's schedulers, as the trainer's",
    "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage": "a storage shared with NumPy is kept, not freed",
    "lightning.pytorch.trainer.trainer.Trainer._fit_impl": "what `fit` hands the launcher, with `ckpt_path`",
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": "torch.compile's prefix of parameter names, stripped",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX": "its prefix, stripped",
    "torch.distributed.fsdp._common_utils.FSDP_PREFIX": "FSDP1's prefix of parameter names, stripped",
    "lightning.fabric.wrappers._FabricModule._forward_module": "Fabric's prefix of parameter names, stripped",
    "timm.models._hub.save_config_for_hf": "`export --format timm`: a model folder's config.json (timm optional)",
}

# The PRIVATE_NAMES entries one torch release renamed: each is resolved (tests/unit/test_compat.py) only on the
# torch versions it exists in, and the code reads the one present.
PRIVATE_NAMES_TORCH = {
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_groups": ">=2.12",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_group": "<2.12",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._force_complete_incomplete_states": ">=2.14",
}

# Prefixes that wrappers add to parameter names: torch.compile, torch's checkpoint wrapper, FSDP1, Fabric.
WRAPPER_PREFIXES = ("_orig_mod.", _CHECKPOINT_PREFIX, FSDP_PREFIX, "_forward_module.")

amp_unscale_and_check = torch._amp_foreach_non_finite_check_and_unscale_
restore_location = torch.serialization._get_restore_location


def starts_a_training_batch(frame: Any) -> bool:
    """Whether a thread whose innermost frame is ``frame`` is in Lightning's broadcast at the start of every training
    batch (>= 2.6: the SIGTERM flag, from rank 0, before the batch is fetched): it ended its previous batch."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    start = getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None)  # absent before Lightning 2.6
    code = getattr(start, "__code__", None)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def default_store() -> Any:
    """The default process group's store, where its rendezvous lives: the handshakes' keys
    (distributed/handshake.py), which must not wait on a collective."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fake_work() -> Any:
    """A finished ``Work`` for a collective the planner keeps on its rank (memory/local_collectives.py): torch's own
    meta kernels for the c10d ops return one the same way (torch/distributed/_meta_registrations.py)."""
    from torch._C._distributed_c10d import FakeWork

    return FakeWork().boxed()


def setup_distributed(strategy: ModelParallelStrategy) -> None:
    strategy._setup_distributed()


def set_device_mesh(strategy: ModelParallelStrategy, module: Any, mesh: Any) -> None:
    """Give ``strategy`` and its LightningModule the mesh (``LightningModule.device_mesh`` reads the module's)."""
    strategy._device_mesh = mesh
    module._device_mesh = mesh


def set_lightning_device(module: torch.nn.Module, device: torch.device) -> None:
    """What ``LightningModule.device`` reports: only ``module.to()`` sets it, which a sharding strategy never calls."""
    module._device = device  # type: ignore[assignment]


def after_closure(plugin: Precision, model: Any, optimizer: Any) -> None:
    """Lightning's post-closure step (gradient clipping hooks) of a precision plugin that runs its own step."""
    plugin._after_closure(model, optimizer)


def dtensor_local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: a DTensor's local shard (without ``to_local()``'s autograd node, so
    for writes under ``no_grad`` and reads of detached values), any other tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def shaped_views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of 1-D ``flat`` shaped as each of ``like``, made in one C++ call (a Python ``view`` each
    cost ~4 us on CPU: 1.7 ms a step for ViT-H's 390 gradients, against 0.9 ms here)."""
    return list(torch._utils._unflatten_dense_tensors(flat, like))


def rebind_local(param: DTensor, local: torch.Tensor) -> None:
    """``param`` stores ``local`` from now on (same shape, dtype and device), as FSDP2 rebinds its sharded
    parameters: the same parameter object, so optimizers, hooks and state keyed by it keep working."""
    param._local_tensor = local


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` as a DTensor laid out as ``like``, without ``DTensor.from_local``'s autograd function and spec.

    ``DTensor.__new__`` alone: ``DTensor(...)`` also runs ``__init__``, which sets nothing (it is there for
    ``torch.export``) but costs 1.5 us under its dynamo-disabling and export-checking decorators, 60% of the call
    (about 0.6 ms a step on a ViT-H-deep model's gradients). Outside compiled code only."""
    return DTensor.__new__(DTensor, local, like._spec, requires_grad=False)


def same_placements(a: Any, b: Any) -> bool:
    """Whether DTensor ``a`` is placed as DTensor ``b`` (``False`` for a plain tensor): first by their spec's
    identity (a gradient made by :func:`dtensor_like` or FSDP2 shares its parameter's), which skips comparing
    placement objects in Python."""
    return isinstance(a, DTensor) and (a._spec is b._spec or a.placements == b.placements)


def parameter_slots(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own parameters by attribute name (``None`` for a registered empty slot), writable in place."""
    return module._parameters


def forward_hook_dicts(module: torch.nn.Module) -> tuple[Any, Any]:
    """``module``'s forward pre-hooks and forward hooks (ordered dicts, id -> hook), for taking a hook out and back
    in without a new handle."""
    return module._forward_pre_hooks, module._forward_hooks


def hook_dicts(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s hook dicts by attribute name (id -> hook, or id -> flag: ``_forward_hooks_with_kwargs``, ...)."""
    return {name: value for name, value in module.__dict__.items() if "hooks" in name and isinstance(value, dict)}


def buffer_slots(module: torch.nn.Module) -> dict[str, Any]:
    return module._buffers


def unsaved_buffer_names(module: torch.nn.Module) -> set[str]:
    return module._non_persistent_buffers_set


@contextmanager
def fake_kernel_failures_unlogged() -> Iterator[None]:
    """torch logs each exception of a fake tensor's (meta) kernel with its traceback at ERROR before raising it
    ("failed while attempting to run meta for ..."); the planner expects some (a step it then measures another way,
    a layer it then keeps in fp32) and says what it did, so its runs leave that log quiet."""
    logger = logging.getLogger(FakeTensor.__module__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def autocast_nesting() -> int:
    """The number of autocast regions open on this thread (torch keeps a nesting count, read here by counting up and
    down again; the count's return to zero clears nothing: that is ``autocast.__exit__``'s job)."""
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level - 1


def autocast_turned_off(device_type: str, floor: int = 0) -> bool:
    """Whether the running code sits inside a ``torch.autocast(device_type, enabled=False)`` of its own: autocast off
    for ``device_type`` while more than ``floor`` autocast regions are open (``floor``: the strategy's own)."""
    return autocast_nesting() > floor and not torch.is_autocast_enabled(device_type)


def tensor_version(tensor: torch.Tensor) -> int:
    return tensor._version


def tensor_backward_hooks(tensor: torch.Tensor) -> list[Callable[[torch.Tensor], Any]]:
    """The hooks ``tensor.register_hook`` registered on it, in order (autograd's ``_backward_hooks``)."""
    return list((tensor._backward_hooks or {}).values())


def tensor_versions(tensors: list[torch.Tensor]) -> list[int]:
    """:func:`tensor_version` of each, in one call: a unit's parameters compared at each of its forwards' ends."""
    return [tensor._version for tensor in tensors]


def plain_data(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.data`` as torch makes it, for a subclass that overrides the ``data`` property's setter."""
    return torch._C.TensorBase.data.__get__(tensor)  # type: ignore[attr-defined]


def hook_counts(module: torch.nn.Module) -> tuple[int, int, int, int]:
    return (len(module._forward_pre_hooks), len(module._forward_hooks), len(module._backward_hooks),
            len(module._backward_pre_hooks))


def storage_id(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def op_mutates(func: Any) -> bool:
    return bool(func._schema.is_mutable)


def op_result_count(func: Any) -> int:
    """How many values the op's schema returns (a c10d op: its tensors and a ``Work``, or a ``Work`` alone)."""
    return len(func._schema.returns)


def written_arguments(func: Any, args: tuple[Any, ...]) -> list[Any]:
    """The positional arguments an op writes in place (``copy_``'s ``self``, an ``out=`` given by position)."""
    return [value for argument, value in zip(func._schema.arguments, args)
            if argument.alias_info is not None and argument.alias_info.is_write]


def checkpointed_op_output(ctx: Any) -> Any:
    """The output of the op a selective-checkpointing policy is deciding on (``SelectiveCheckpointContext.op_output``,
    torch >= 2.12); ``None`` on torch 2.11, whose policies run before the op and never see its output."""
    return getattr(ctx, "op_output", None)


TRUNC_NORMAL_IMPL = "_no_grad_trunc_normal_"
INIT_METHODS = ("reset_parameters", "_reset_parameters")


def unscales_in_step(optimizer: Any) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def dtensor_takes_plain_as_replicated() -> bool:
    """Inside torch's ``implicit_replication()``: DTensor takes every plain tensor as replicated."""
    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def dtensor_op_handlers() -> dict[Any, Callable[..., Any]]:
    """DTensor's table of ops it hands to a Python function instead of sharding propagation (one per process)."""
    return DTensor._op_dispatcher._custom_op_handlers  # type: ignore[no-any-return]


def log_whole_values(convert: Callable[[Any, bool], Any]) -> None:
    """Lightning's logged values pass through ``convert(value, rank_zero_only)`` as ``self.log`` takes them (its
    ``_ResultMetric.update``; each metric wraps it when made, so this acts on metrics made afterwards). Once."""
    update = _ResultMetric.update
    if getattr(update, "vitscale_converts_values", False):
        return

    @functools.wraps(update)
    def update_with_converted(self: Any, value: Any, batch_size: int) -> None:
        update(self, convert(value, bool(self.meta.sync.rank_zero_only)), batch_size)

    update_with_converted.vitscale_converts_values = True  # type: ignore[attr-defined]
    _ResultMetric.update = update_with_converted  # type: ignore[method-assign]


def read_dtensor_arrays(numpy: Callable[[DTensor, bool], Any]) -> None:
    """``DTensor.numpy()`` (``np.asarray(t)`` and TensorBoard's histograms call it) as ``numpy(tensor, force)``, where
    torch refuses every tensor subclass. Process-wide (DTensor is one class for all), once."""
    if getattr(DTensor.__dict__.get("numpy"), "vitscale_reads_arrays", False):
        return

    def dtensor_numpy(self: DTensor, *, force: bool = False) -> Any:
        return numpy(self, force)

    dtensor_numpy.vitscale_reads_arrays = True  # type: ignore[attr-defined]
    DTensor.numpy = dtensor_numpy  # type: ignore[method-assign,assignment]


def keep_storages_shared_with_numpy() -> None:
    """FSDP2 frees a gathered parameter's storage by resizing it to 0 at reshard; ``.numpy()`` of that parameter in a
    step (on CPU: TensorBoard's ``add_histogram``) makes the storage unresizable, and the reshard raised "Trying to
    resize storage that is not resizable". Such a storage stays allocated instead (its next all-gather fills it as
    it is). Process-wide, once."""
    free = _fsdp_param_module.free_storage
    if getattr(free, "vitscale_keeps_numpy_shares", False):
        return

    @functools.wraps(free)
    def free_storage(tensor: torch.Tensor) -> None:
        if tensor.untyped_storage().resizable():
            free(tensor)

    free_storage.vitscale_keeps_numpy_shares = True  # type: ignore[attr-defined]
    _fsdp_param_module.free_storage = free_storage


def wrap_dtensor(local: torch.Tensor, mesh: Any, placements: tuple[Any, ...]) -> DTensor:
    """A DTensor of ``local`` (whose global shape is its own: a reduction's result), as DTensor's op handlers make
    theirs: below autograd, with no check or communication."""
    meta = TensorMeta(shape=local.shape, stride=local.stride(), dtype=local.dtype)
    return DTensor(local, DTensorSpec(mesh, placements, tensor_meta=meta), requires_grad=local.requires_grad)


def has_post_accumulate_grad_hooks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_post_accumulate_grad_hooks", None))


foreach_copy_ = torch._foreach_copy_
foreach_lerp_ = torch._foreach_lerp_
foreach_mul_ = torch._foreach_mul_
foreach_add_ = torch._foreach_add_


def process_group_timeout(strategy: ModelParallelStrategy) -> Any:
    """The ``timeout`` a ``ModelParallelStrategy`` was built with (``None`` for Lightning's default)."""
    return strategy._timeout


def averaged_model(callback: Any) -> Any:
    """A ``WeightAveraging``/``StochasticWeightAveraging`` callback's averaged copy (``None`` before setup)."""
    return callback._average_model


def averaging_device(callback: Any) -> Any:
    """The ``device`` a ``WeightAveraging`` callback keeps its copy on (``None``: the model's)."""
    return getattr(callback, "_device", None)


def on_child_failure(procs: list[Any], terminate: Callable[[], None]) -> None:
    """Make Lightning's watcher of ``procs`` call ``terminate`` when a child fails, instead of SIGKILLing every child
    and this process at once."""
    for thread in threading.enumerate():
        if isinstance(thread, ChildProcessObserver) and thread._child_processes is procs:
            thread._terminate_all = terminate  # type: ignore[method-assign]


def initialize_fsdp_root(root: FSDPModule) -> None:
    """FSDP2's lazy initialisation, now, with ``root`` as the root: else a child unit called first (``pl_module.net(x)``
    in ``on_train_start``) becomes a root and breaks the step ("FSDP state has already been lazily initialized")."""
    root._get_fsdp_state()._lazy_init()


# torch 2.14's FSDP2 root completes, at its post-forward, a unit of several modules (``fully_shard([a, b])``) whose
# forward ran only some of them, and runs such a unit's pre-forward at every module; torch 2.11's does neither.
_COMPLETES_PARTIAL_UNITS = hasattr(FSDPState, "_force_complete_incomplete_states")


def grouped_unit_states(root: torch.nn.Module) -> list[Any]:
    """The FSDP2 states under ``root`` shared by several modules (a unit of consecutive blocks), deepest first; none
    where torch completes such units itself (see :func:`complete_partial_forwards`)."""
    if _COMPLETES_PARTIAL_UNITS:
        return []
    states: dict[int, Any] = {}
    for module in root.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if len(getattr(state, "_modules", ())) > 1:
                states[id(state)] = state
    return list(reversed(states.values()))


def complete_partial_forwards(states: list[Any], output: Any) -> Any:
    """torch 2.11: a unit of several blocks whose forward ran only some of them (one block called from a callback, a
    forward that skips a block) never ran its post-forward, and FSDP2 then skips its pre-forward at every later call,
    so the next forward meets its sharded parameters ("got mixed torch.Tensor and DTensor"). Finish it as torch 2.14's
    root does (``_force_complete_incomplete_states``): reshard, the pre-backward hook on ``output``, idle again."""
    for state in states:
        if not state._modules_to_run_forward:
            continue
        group = state._fsdp_param_group
        if group is not None:
            output = group.post_forward(None, None, output)
        output = state._register_pre_backward_hook(output)
        state._training_state = type(state._training_state).IDLE
        state._modules_to_run_forward.clear()
    return output


def drop_partial_forwards(states: list[Any]) -> None:
    """torch 2.11, before a new forward: a unit left part-run by an earlier call (one of its blocks called alone) is
    resharded, so the new forward gathers it afresh (not the copy of before an optimizer step) and runs its
    pre-forward, which FSDP2 would skip."""
    for state in states:
        if not state._modules_to_run_forward:
            continue
        idle = type(state._training_state).IDLE
        group = state._fsdp_param_group
        if group is not None:
            group._training_state = idle  # a unit kept gathered after forward skips a reshard asked in FORWARD
            group.reshard()
        state._training_state = idle
        state._modules_to_run_forward.clear()


def set_unshard_async(unit: FSDPModule, async_op: bool) -> None:
    """All-gathers of ``unit`` and the units below it issued async: on CPU (no streams) the only overlap of a gather."""
    unit._set_unshard_async_op(async_op)


def fsdp_param_groups(unit: FSDPModule) -> list[Any]:
    """FSDP2's parameter groups of ``unit`` itself (none for a unit that holds no parameter of its own): a list
    since torch 2.12 (``_fsdp_param_groups``), one optional group before (``_fsdp_param_group``, torch 2.11)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch 2.11
    return [group] if group is not None else []


def reduction_streams(unit: FSDPModule) -> list[Any]:
    """The streams on which FSDP2 writes ``unit``'s gradient shards (its reduce-scatter's, and the all-reduce's under
    hybrid sharding: the post-reduce work runs on one of them), once its first forward made them."""
    streams: list[Any] = []
    for group in fsdp_param_groups(unit):
        context = getattr(group, "comm_ctx", None)
        for name in ("reduce_scatter_stream", "all_reduce_stream"):
            stream = getattr(context, name, None)
            if stream is not None and stream not in streams:
                streams.append(stream)
    return streams


def requires_gradient_sync(unit: FSDPModule) -> bool:
    """What ``unit.set_requires_gradient_sync`` last set for ``unit`` itself (FSDP2 has no getter)."""
    return all(group.reduce_grads for group in fsdp_param_groups(unit))


def unit_keeps_gathered(unit: FSDPModule) -> bool:
    """Whether ``unit`` keeps its gathered parameters from forward to backward (``False``: it holds none itself)."""
    groups = fsdp_param_groups(unit)
    return bool(groups) and all(group.post_forward_mesh_info is None for group in groups)


def _fsdp_params(unit: FSDPModule) -> list[Any]:
    """FSDP2's record of each parameter ``unit`` itself manages (not those of the units nested in it)."""
    return [p for group in fsdp_param_groups(unit) for p in group.fsdp_params]


def unit_parameters(unit: FSDPModule) -> list[torch.nn.Parameter]:
    """The sharded parameters ``unit`` itself manages (not those of the units nested in it)."""
    return [p.sharded_param for p in _fsdp_params(unit)]


def gathered_to_sharded(unit: FSDPModule) -> dict[int, Any]:
    """By id, each gathered parameter ``unit`` made (registered on its modules while gathered) -> its DTensor."""
    params = _fsdp_params(unit)
    return {id(p._unsharded_param): p.sharded_param for p in params if getattr(p, "_unsharded_param", None) is not None}


# The name FSDP2 calls its reduce-scatter by: ``reduce_scatter_single`` since torch 2.12, which deprecates the older
# ``reduce_scatter_tensor`` (torch 2.11 has only that one).
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
    """FSDP2's reduce-scatter (:data:`REDUCE_SCATTER`) looked up at each call, as FSDP2 does: tools wrapping it
    see ours too."""
    return getattr(dist, REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


def keep_storage_data(writer: Any) -> Any:
    """``writer`` whose ``finish`` also records which file holds each value (``storage_data``) on the ``Metadata``
    that ``dcp.save`` returns, as torch >= 2.12 does itself: torch 2.11's ``FileSystemWriter.finish`` fills a copy
    (``dataclasses.replace``), so the returned one lists no file."""
    finish = writer.finish

    def finish_keeping_storage_data(metadata: Any, results: Any) -> None:
        metadata.storage_data = {result.index: result.storage_data for batch in results for result in batch}
        finish(metadata=metadata, results=results)

    writer.finish = finish_keeping_storage_data
    return writer


def current_backward_id() -> int:
    """The id of the backward pass running on this thread (-1 outside one): a new id per ``backward()`` call, so
    state keyed by it cannot outlive a backward that raised (its queued callbacks never ran)."""
    return int(torch._C._current_graph_task_id())


def hook_root_pre_backward(root: FSDPModule, loss: torch.Tensor) -> None:
    """FSDP2's pre-backward of the root unit on ``loss``, as FSDP2 hooks it on the root's forward outputs: its
    backward then ends in FSDP2's root post-backward (each gathered unit's gradients reduced, the units resharded).
    Registered on the tensor itself, not through ``_register_pre_backward_hook``, which warns of views (a loss is
    never written in place after ``backward`` starts)."""
    if loss.requires_grad:
        loss.register_hook(root._get_fsdp_state()._pre_backward)


def gathered_of_shards(groups: list[Any]) -> dict[int, torch.nn.Parameter]:
    """By id, each sharded parameter of ``groups`` (:func:`unit_param_groups`) -> the gathered parameter its unit's
    forwards compute with (one object per parameter, its storage freed while resharded; made at the first gather)."""
    return {id(p.sharded_param): p._unsharded_param for group in groups for p in group.fsdp_params
            if getattr(p, "_unsharded_param", None) is not None}


def unit_param_groups(root: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of every unit under ``root``, ``root`` included (fixed once units are made)."""
    return [group for unit in root.modules() if isinstance(unit, FSDPModule) for group in fsdp_param_groups(unit)]


def keep_units_gathered(groups: list[Any]) -> Callable[[], None]:
    """The units of ``groups`` (:func:`unit_param_groups`) left gathered after their forwards and backwards until the
    returned function is called, which restores each unit's own settings (they differ per unit: the planner keeps
    some gathered for backward). FSDP2's public setters take one value for all units and cannot say what was set."""
    saved = [(group, group.post_forward_mesh_info, group.reshard_after_backward) for group in groups]
    for group, _, _ in saved:
        group.post_forward_mesh_info, group.reshard_after_backward = None, False

    def restore() -> None:
        for group, after_forward, after_backward in saved:
            group.post_forward_mesh_info, group.reshard_after_backward = after_forward, after_backward

    return restore


@contextmanager
def gradient_calls_seen(before: Callable[[bool, Any, bool], Any]) -> Iterator[None]:
    """``before(create_graph, inputs, accumulate)`` runs ahead of each ``torch.autograd.grad`` call in the block
    (``accumulate`` False), and of each ``backward`` given ``inputs=`` (True), however the function was imported
    (``from torch.autograd import grad`` before the block binds torch's own function, which a swap of
    ``torch.autograd.grad`` cannot reach): both call ``_engine_run_backward`` from their module's namespace, the tensors
    they differentiate for (a tuple, empty for a plain ``backward``) fourth. ``before`` returns the tensors to
    differentiate for instead. ``torch.autograd.functional`` and ``grad`` alike."""
    engine = torch.autograd._engine_run_backward

    def run(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        accumulate = kwargs.get("accumulate_grad", True)
        if len(args) > 3 and (not accumulate or args[3]):
            args = (*args[:3], before(bool(args[2]), args[3], accumulate), *args[4:])
        return engine(t_outputs, *args, **kwargs)

    torch.autograd._engine_run_backward = run
    try:
        yield
    finally:
        torch.autograd._engine_run_backward = engine


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def checkpoint_dir(callback: Any, trainer: Any) -> str:
    """The folder a ``ModelCheckpoint`` saves to (its ``dirpath``, or Lightning's default under the logger)."""
    return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))


def with_ckpt_path(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], resolve: Callable[[Any], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments a launcher hands ``function`` (the Trainer's private ``_fit_impl``, ``_validate_impl``, ...),
    with its ``ckpt_path`` argument replaced by ``resolve(ckpt_path)``; unchanged for a function without one."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    if "ckpt_path" not in bound.arguments:
        return args, kwargs
    bound.arguments["ckpt_path"] = resolve(bound.arguments["ckpt_path"])
    return bound.args, bound.kwargs


def sigterm_handlers_but_lightnings(handler: Any) -> list[Callable[..., Any]]:
    """What Lightning's registered SIGTERM handler runs besides its own notifier (which broadcasts inside the
    handler): the handler installed before it, if any; ``[handler]`` if ``handler`` is not Lightning's."""
    if not isinstance(handler, _HandlersCompose):
        return [handler] if callable(handler) else []
    notifier = _SignalConnector._sigterm_notifier_fn
    return [h for h in handler.signal_handlers if callable(h) and getattr(h, "__func__", None) is not notifier]


def mark_sigterm_received(trainer: Any) -> None:
    """What Lightning's SIGTERM notifier records: its loops raise ``SIGTERMException`` at the next batch boundary."""
    trainer._signal_connector.received_sigterm = True


def configured_optimizers(configured: Any, automatic: bool) -> tuple[list[Any], list[Any]]:
    """The optimizers and scheduler configs (``LRSchedulerConfig``, as ``trainer.lr_scheduler_configs`` lists them) of
    what ``configure_optimizers()`` returned, in each form Lightning takes, parsed as Lightning parses them."""
    optimizers, schedulers, monitor = _configure_optimizers(configured)
    if automatic:
        return optimizers, _configure_schedulers_automatic_opt(schedulers, monitor)
    return optimizers, _configure_schedulers_manual_opt(schedulers)


def train_dataloader(trainer: Any) -> Any:
    """What ``Trainer.fit`` will train on, before Lightning sets it up (``None``: nothing)."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() else None


@contextlib.contextmanager
def real_numpy() -> Iterator[None]:
    """In the body, ``.numpy()`` of a fake tensor carrying a real one (and so ``np.asarray``, SciPy's Hungarian
    matching in DETR-style losses) is the real one's; one carrying none raises as before."""
    refused = FakeTensor.__dict__.get("numpy")

    def numpy(self: Any, *, force: bool = False) -> Any:
        real = getattr(self, "real_tensor", None)
        if real is None:
            raise RuntimeError(".numpy() is not supported for tensor subclasses.")
        with disable_current_modes():  # the real tensor's ops, not the fake mode's
            return real.detach().numpy(force=force)

    FakeTensor.numpy = numpy  # type: ignore[method-assign]
    try:
        yield
    finally:
        if refused is None:
            del FakeTensor.numpy
        else:
            FakeTensor.numpy = refused  # type: ignore[method-assign]


def propagating_real_tensors() -> Any:
    """Around making a ``FakeTensorMode`` and running it: its fake tensors carry real ones, which decide
    data-dependent branches, and where an op's fake result disagrees with its real one (an index taken from a value
    gives a symbolic storage offset) the real one's shape stands (torch.export's draft mode sets both)."""
    return functorch_config.patch(fake_tensor_propagate_real_tensors=True,
                                  generate_fake_kernels_from_real_mismatches=True)


def compile_context(module: Any) -> Any:
    ctx = getattr(module, "_compiler_ctx", None)
    return None if ctx is None else ctx["dynamo_ctx"]


def timm_save_config_for_hf() -> Callable[..., None]:
    """timm's writer of the ``config.json`` that ``timm.create_model("local-dir:...")`` reads (public only inside
    ``save_for_hf``, which also writes the weights); timm is optional: imported on call."""
    from timm.models._hub import save_config_for_hf

    return save_config_for_hf


# The names imported above for other modules (the functions defined here need no listing).
__all__ = [
    "dynamo", "ChildProcessObserver", "destroy_process_group_safely", "METADATA_FILENAME",
    "optimizers_to_device", "SubprocessScriptLauncher", "ModelParallelStrategy", "FakeTensor", "FakeTensorMode",
    "rebuild_from_type_v2", "rebuild_tensor_v2", "FsspecReader", "FsspecWriter", "StorageInfo",
    "EmptyStateDictLoadPlanner", "dcp_load_into", "ReduceScatterComm", "compute_local_shape_and_global_offset",
    "ShapeEnv", "StorageWeakRef", "BatchNormBase", "InstanceNormBase", "fused_kernel_devices", "get_layout",
    "TorchDispatchMode", "tree_leaves", "tree_map", "REDUCE_SCATTER", "checkpointed_op_output",
]


# torch's own namespaces: O2 computes their ops in the compute dtype on purpose, autocast's lists do not apply.
_TORCH_OP_NAMESPACES = frozenset({"aten", "prims", "debugprims", "rngprims", "inductor", "inductor_prims"})


def ops_with_autocast_kernels() -> dict[tuple[str, str], frozenset[str]]:
    """``(namespace, op)`` -> the device types (``"cpu"``, ``"cuda"``, ...) for which a library outside torch
    registered an autocast kernel for the op (torchvision: ``nms`` and ``roi_align`` everywhere, its other ops on
    CUDA). A few milliseconds: called once per setup."""
    keys = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU"}
    found: dict[tuple[str, str], frozenset[str]] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        if namespace in _TORCH_OP_NAMESPACES or not rest:
            continue
        devices = frozenset(device for device, key in keys.items()
                            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key))
        if devices:  # an overload ("op.out") is reached through its op's packet
            op = (namespace, rest.partition(".")[0])
            found[op] = found.get(op, frozenset()) | devices
    return found
