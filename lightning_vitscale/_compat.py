"""Every private torch/Lightning import and version gate lives here, so upgrades touch one file.

Public torch names (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``DTensor``, ...) are imported from
torch where they are used, not through this module."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])
# The oldest torch whose API the code uses: `fully_shard(..., ignored_params=)` (fp32 norms kept out of the bf16
# units) arrived in 2.7. pyproject's floor is higher: the oldest torch the test suite has passed on (see README).
TORCH_API_MIN = Version("2.7")
if TORCH_VERSION < TORCH_API_MIN:  # pragma: no cover - pyproject requires a newer torch: a clear message if not
    raise ImportError(
        f"lightning-vitscale needs torch>={TORCH_API_MIN} for FSDP2 `fully_shard(..., ignored_params=)`;"
        f" found {torch.__version__}. Upgrade torch: `pip install -U 'torch>=2.14'` (the oldest version tested)."
    )

# Below the gate, so an old torch fails with the message above rather than on a missing name (ruff: E402 allowed
# in this file only, see pyproject.toml).
import torch._dynamo as dynamo  # regional compilation's dynamo options (kernels/compile.py)
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver as ChildProcessObserver
from lightning.fabric.utilities.distributed import _destroy_dist_connection as destroy_process_group_safely
from lightning.fabric.utilities.load import _METADATA_FILENAME as METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # memory planner: shapes without memory
from torch._tensor import _rebuild_from_type_v2 as rebuild_from_type_v2  # FSDP1 local files: a tensor subclass
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor_v2  # FSDP1 local files: a plain tensor, pickled
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # s3://, gs://, memory://
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo  # where a DCP value lies in a file
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_into
from torch.distributed.fsdp import FSDPModule  # public: only for the annotations below (import it from torch)
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterComm  # FSDP2 custom comms
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # a DTensor shard's box (init/)
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # planner: a step's .item() on fake tensors
from torch.multiprocessing.reductions import StorageWeakRef  # planner: a storage's life, whoever holds it
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.nn.modules.instancenorm import _InstanceNorm as InstanceNormBase
from torch.optim.optimizer import _get_fused_kernels_supported_devices as fused_kernel_devices
from torch.serialization import _get_layout as get_layout  # FSDP1 local files: a tensor's layout, pickled
from torch.utils._pytree import tree_leaves, tree_map

# `dcp_load_into` reads a whole DCP checkpoint into one process with no process group, as `dcp_to_torch_save`
# does (the public `dcp.load` fills a copy of the state dict, so the populated keys would be lost).

# Private hooks this package overrides (strategy.py, precision/grad_scaler.py) or calls (below): fail at import,
# naming the hook, rather than mid-training, if an upgrade removes one. (`Strategy._precision_plugin`, the slot
# behind the `precision_plugin` property that strategy.py overrides, is an instance attribute: not checkable here.)
_PRIVATE_HOOKS = (
    (ModelParallelStrategy, "_configure_launcher"),
    (ModelParallelStrategy, "_setup_distributed"),
    (Precision, "_after_closure"),
    (torch.amp.GradScaler, "_unscale_grads_"),
    (ModelCheckpoint, "_ModelCheckpoint__resolve_ckpt_dir"),
    (Trainer, "_fit_impl"),  # what `fit` hands the strategy's launcher, with `ckpt_path` (see `with_ckpt_path`)
)
_missing = [f"{cls.__name__}.{name}" for cls, name in _PRIVATE_HOOKS if not hasattr(cls, name)]
if hasattr(Trainer, "_fit_impl") and "ckpt_path" not in inspect.signature(Trainer._fit_impl).parameters:
    _missing.append("Trainer._fit_impl(ckpt_path=)")
_missing += [] if hasattr(torch.serialization, "_get_restore_location") else [
    "torch.serialization._get_restore_location"]
if _missing:  # pragma: no cover - depends on the installed torch/Lightning
    raise ImportError(
        f"lightning-vitscale relies on {', '.join(_missing)}, which this torch/Lightning install lacks."
        " Install a supported pair: `pip install 'torch>=2.14' 'lightning>=2.5,<3'`."
    )

# The fused unscale + inf/nan check GradScaler itself uses, applied to DTensor gradients' local shards.
amp_unscale_and_check = torch._amp_foreach_non_finite_check_and_unscale_
# torch.load's rule for `map_location` (device, string, dict or callable) applied to one storage.
restore_location = torch.serialization._get_restore_location


def setup_distributed(strategy: ModelParallelStrategy) -> None:
    """Lightning's process-group setup for ``strategy``: device, ranks and the process group with its timeout."""
    strategy._setup_distributed()


def set_device_mesh(strategy: ModelParallelStrategy, module: Any, mesh: Any) -> None:
    """Give ``strategy`` and its LightningModule the mesh (``LightningModule.device_mesh`` reads the module's)."""
    strategy._device_mesh = mesh
    module._device_mesh = mesh


def set_lightning_device(module: torch.nn.Module, device: torch.device) -> None:
    """What ``LightningModule.device`` reports: Lightning's device mixin keeps it in ``_device``, updated only by
    ``module.to(...)``, which a strategy that shards instead of moving never calls."""
    module._device = device  # type: ignore[assignment]


def after_closure(plugin: Precision, model: Any, optimizer: Any) -> None:
    """Lightning's post-closure step (gradient clipping hooks) of a precision plugin that runs its own step."""
    plugin._after_closure(model, optimizer)


def dtensor_local(tensor: Any) -> torch.Tensor:
    """A DTensor's local tensor itself, with no autograd node (``to_local()`` records one while grad is on)."""
    return tensor._local_tensor


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` as a DTensor laid out as ``like`` (mesh, placements, global shape, strides, dtype), without
    ``DTensor.from_local``'s autograd function and spec building: for gradients handed over every step."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def set_parameters(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Put ``tensors`` in ``module``'s parameter slots as they are (plain tensors too), no ``nn.Parameter`` check."""
    module._parameters.update(tensors)  # type: ignore[arg-type]  # plain tensors on purpose


def on_child_failure(procs: list[Any], terminate: Callable[[], None]) -> int:
    """Make Lightning's watcher thread of ``procs`` call ``terminate`` once a child exits non-zero, instead of its
    own ``_terminate_all`` (SIGKILL to every child and to this process at once); returns how many it found."""
    observers = [
        thread
        for thread in threading.enumerate()
        if isinstance(thread, ChildProcessObserver) and thread._child_processes is procs
    ]
    for observer in observers:
        observer._terminate_all = terminate  # type: ignore[method-assign]
    return len(observers)


def initialize_fsdp_root(root: FSDPModule) -> None:
    """FSDP2's lazy initialisation, now, with ``root`` as the root: it fixes which unit is the root (and wires the
    shared communication state) at the first forward of *any* unit, so a first call of a child unit, made before
    the first step (``pl_module.net(x)`` in ``on_train_start``), would make that child a root and break the step
    (``FSDP state has already been lazily initialized for ...``). No-op once initialised."""
    root._get_fsdp_state()._lazy_init()


def set_unshard_async(unit: FSDPModule, async_op: bool) -> None:
    """FSDP2's all-gathers of ``unit`` and the units below it issued with ``async_op`` (a ``Work`` waited for at
    the unit's first use): on CPU, where there are no streams, the only way a prefetched gather overlaps compute."""
    unit._set_unshard_async_op(async_op)


def fsdp_param_groups(unit: FSDPModule) -> list[Any]:
    """FSDP2's parameter groups of ``unit`` itself (none for a unit that holds no parameter of its own): a list
    since torch 2.12 (``_fsdp_param_groups``), one optional group before (``_fsdp_param_group``)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []  # torch <= 2.11


def unit_keeps_gathered(unit: FSDPModule) -> bool:
    """Whether ``unit`` keeps its gathered parameters from forward to backward as set now (FSDP2 holds no mesh to
    reshard to after forward: ``post_forward_mesh_info`` is ``None``); ``False`` for a unit without parameters."""
    groups = fsdp_param_groups(unit)
    return bool(groups) and all(group.post_forward_mesh_info is None for group in groups)


def unit_parameters(unit: FSDPModule) -> list[torch.nn.Parameter]:
    """The sharded parameters ``unit`` itself manages (not those of the units nested in it)."""
    return [p.sharded_param for group in fsdp_param_groups(unit) for p in group.fsdp_params]


# The name FSDP2 calls its reduce-scatter by (``reduce_scatter_single`` since torch 2.12; it deprecates the older
# ``reduce_scatter_tensor``): looked up on ``torch.distributed`` at each call, as FSDP2 does, so tools that wrap
# the collective (tests counting them) see ours too.
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
    """``torch.distributed``'s tensor reduce-scatter under this torch's name for it (:data:`REDUCE_SCATTER`)."""
    return getattr(dist, REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


def keep_storage_data(writer: Any) -> Any:
    """``writer`` whose ``finish`` also records which file holds each value (``storage_data``) on the
    ``Metadata`` object that ``dcp.save`` returns, as torch >= 2.12 does itself: torch 2.11's
    ``FileSystemWriter.finish`` fills a copy (``dataclasses.replace``), so the returned one lists no file."""
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


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running ends (autograd's final callbacks, as FSDP2's own)."""
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


def train_dataloader(trainer: Any) -> Any:
    """What ``Trainer.fit`` will train on (the ``train_dataloaders`` argument, the module's or datamodule's
    ``train_dataloader()``), before Lightning sets it up; ``None`` when there is none."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() else None


def compile_context(module: Any) -> Any:
    """The compile context Lightning's ``from_compiled`` left on a LightningModule (``None`` if not compiled)."""
    ctx = getattr(module, "_compiler_ctx", None)
    return None if ctx is None else ctx["dynamo_ctx"]



def timm_save_config_for_hf() -> Callable[..., None]:
    """timm's writer of a model folder's ``config.json`` (architecture, ``model_args``, ``pretrained_cfg``), the file
    ``timm.create_model("local-dir:...")`` reads; private (``timm.models._hub``): public only inside ``save_for_hf``,
    which also writes the weights itself. timm is optional: imported on call (``export --format timm``)."""
    from timm.models._hub import save_config_for_hf

    return save_config_for_hf

__all__ = [
    "compute_local_shape_and_global_offset",
    "BatchNormBase",
    "ChildProcessObserver",
    "EmptyStateDictLoadPlanner",
    "FakeTensor",
    "FakeTensorMode",
    "ShapeEnv",
    "StorageWeakRef",
    "FsspecReader",
    "FsspecWriter",
    "InstanceNormBase",
    "METADATA_FILENAME",
    "ModelParallelStrategy",
    "ReduceScatterComm",
    "StorageInfo",
    "SubprocessScriptLauncher",
    "TORCH_VERSION",
    "after_closure",
    "checkpoint_dir",
    "amp_unscale_and_check",
    "compile_context",
    "current_backward_id",
    "dcp_load_into",
    "dtensor_like",
    "dtensor_local",
    "destroy_process_group_safely",
    "dynamo",
    "fsdp_param_groups",
    "fused_kernel_devices",
    "get_layout",
    "initialize_fsdp_root",
    "keep_storage_data",
    "on_child_failure",
    "optimizers_to_device",
    "queue_end_of_backward",
    "rebuild_from_type_v2",
    "rebuild_tensor_v2",
    "REDUCE_SCATTER",
    "reduce_scatter",
    "restore_location",
    "set_device_mesh",
    "set_lightning_device",
    "set_parameters",
    "set_unshard_async",
    "setup_distributed",
    "timm_save_config_for_hf",
    "tree_leaves",
    "tree_map",
    "train_dataloader",
    "unit_keeps_gathered",
    "unit_parameters",
    "with_ckpt_path",
]


def cuda_memory_fraction(device: torch.device) -> float:
    """The share of ``device``'s memory this process may allocate (``torch.cuda.set_per_process_memory_fraction``;
    ``torch.cuda.get_per_process_memory_fraction`` is newer than some supported torch versions: 1.0 without it)."""
    read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return float(read(device)) if read is not None else 1.0
